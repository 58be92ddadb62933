#!/usr/bin/env python3
"""The coefficients of poly_exp2_unit (src/kernels/exp-inl.h): 2^f on [0, 1) by a polynomial of
degree 4 with p(0) = 1 exactly (so exp(0) and every power of two come out exact: a row of equal
scores gives probabilities of exactly 1), the other four chosen for the smallest largest relative
error by Lawson's iteration (weighted least squares whose weights grow where the error is large).
Prints the float32 coefficients and the largest relative error of their float32 Horner evaluation.

usage: /usr/bin/python3 scripts/fit_exp2.py [DEGREE]   (python3-numpy)
"""
import sys

import numpy as np


def fit(degree: int, points: int = 40000, iterations: int = 500):
    f = np.linspace(0.0, 1.0, points + 1)[1:]
    y = 2.0**f
    # p(f) = 1 + c1 f + … + c_deg f^deg; the relative error p/y − 1 is linear in c: A c − b.
    a = np.stack([f**k / y for k in range(1, degree + 1)], axis=1)
    b = 1.0 - 1.0 / y
    w = np.ones_like(f)
    for _ in range(iterations):
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(a * sw[:, None], b * sw, rcond=None)
        w = w * np.abs(a @ c - b) + 1e-300
        w /= w.sum()
    coeffs = np.concatenate([[1.0], c]).astype(np.float32)
    f32 = f.astype(np.float32)
    p = np.zeros_like(f32)
    for k in reversed(range(degree + 1)):
        p = p * f32 + coeffs[k]
    return coeffs, float(np.max(np.abs(p / y - 1.0)))


if __name__ == "__main__":
    degree = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    coeffs, err = fit(degree)
    for k, c in enumerate(coeffs):
        print(f"c{k} = {float(c)!r}")
    print(f"largest relative error over [0, 1): {err:.2e}")
