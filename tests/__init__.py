"""autotp's test suite, a package beside ``autotp`` in the checkout (never installed): its
helpers are imported as ``tests.models``, ``tests.dist_cases``, ... with the repository root on
``sys.path`` (pytest puts it there: pyproject.toml's ``pythonpath``)."""
