"""CPU cost of one small dropin call, by function (cProfile): where the launch overhead goes."""
import cProfile
import pstats

import torch

import dropin

a = torch.randn(2, 1, 512, device="cuda")
b = torch.randn(2, 512, 1000, device="cuda")
for _ in range(20):
    dropin.bmm(a, b)
torch.cuda.synchronize()
profile = cProfile.Profile()
profile.enable()
for _ in range(2000):
    dropin.bmm(a, b)
profile.disable()
torch.cuda.synchronize()
pstats.Stats(profile).sort_stats("tottime").print_stats(18)
