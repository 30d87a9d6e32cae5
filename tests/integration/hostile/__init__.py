"""Code a hostile run spec names: each module misbehaves in one way (tests/integration/
test_untrusted_inputs.py). Importing this package does nothing."""
