"""Code generation from coefficient files (coeffs/<activation>/<family>.json).

This package reads the JSON contract (`codegen.coeffs_json`) and never imports `fitting`.
"""
