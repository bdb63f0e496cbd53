"""The demo's lab reports: the paper's theorems measured, the kernels checked against the reference and timed."""
