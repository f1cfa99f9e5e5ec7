# On the GPU machine: the card's device-to-device copy bandwidth in GB/s (bytes read plus bytes
# written, best of ten copies of 4 GiB), for decode-bench-device.sh's COPY_GBS on a card other
# than the H200.
import sys

try:
    import torch
except ImportError:
    sys.exit("copy-bandwidth.py: needs torch (the GPU machine has it)")
if not torch.cuda.is_available():
    sys.exit("copy-bandwidth.py: no CUDA device visible to torch")
size = 4 << 30
src = torch.empty(size, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
for _ in range(3):
    dst.copy_(src)
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
best = 0.0
for _ in range(10):
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    best = max(best, 2 * size / (start.elapsed_time(end) * 1e-3) / 1e9)
print(f"{best:.0f}")
