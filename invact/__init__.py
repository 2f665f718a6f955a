"""invact: Inverted Activations for PyTorch training (the runtime; imports torch alone).

The drop-in modules and their kernels are generated from the fitted coefficients in coeffs/;
see README.md for what is available in this version.
"""

__version__ = "0.1.0"
