"""Engine tests that need CUDA (python -m pytest -m gpu) and their CPU-side mocks."""
