#!/bin/sh
# PyTorch's nn.MultiheadAttention on mha bench's shapes (see pytorch_mha.py). OMP_WAIT_POLICY=passive
# must be set before torch starts its OpenMP runtime: PyTorch is up to 4x faster here with it.
OMP_WAIT_POLICY=passive exec /usr/bin/python3 "$(dirname "$0")/pytorch_mha.py" "$@"
