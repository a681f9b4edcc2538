"""WRONG on purpose: fails while importing, as a kernel file whose nvcc build fails does."""
raise RuntimeError("Error building extension 'broken_build': nvcc exited with status 1 (simulated)")
