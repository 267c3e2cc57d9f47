"""The test suite, a package: shared helpers are imported as ``tests.reference`` and ``tests.train_helpers``."""
