"""autotp's benchmarks, a package beside ``autotp`` in the checkout (never installed). Each
script runs from the repository root as a module, ``python -m benchmarks.NAME``, and imports
its neighbours the same way (``benchmarks.harness``, ``tests.models``)."""
