"""Code tables published by other projects, written out here as the tests' references."""

import numpy as np

# bitsandbytes/functional.py get_4bit_type("nf4") and csrc/kernels.cu nf4_dequantization_lut.
BNB_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
           -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
           0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
           0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
NF4 = np.array(BNB_NF4, np.float32)
# bitsandbytes get_4bit_type("fp4"), before its normalization by the largest magnitude (12).
BNB_FP4 = [0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0, -0.0625, -8.0, -12.0, -4.0, -6.0,
           -2.0, -3.0]
