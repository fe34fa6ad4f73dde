"""The suite plans afresh: a plan cached by one test (``autotp.planner.cache``) would hide
what another test changes (a monkeypatched search, a narrower beam). tests/test_cache.py
turns the cache on, in a temporary directory."""

import os

os.environ["AUTOTP_CACHE"] = "0"
