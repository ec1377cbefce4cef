"""The cost of the registry operator's gradient check (issue 66): three sums of
(1, 8, 16384, 64) float32 gradients, against linear attention's forward+backward
through fastattn.attention on the same shapes (min and median of 20, 2 threads).

  .venv/bin/python bench/python/bench_gradient_check_cost.py
"""
import time, torch, fastattn
torch.set_num_threads(2)
g = [torch.randn(1, 8, 16384, 64) for _ in range(3)]
def sums(): return [x.sum().item() for x in g]
q, k, v = (torch.randn(1, 8, 16384, 64, requires_grad=True) for _ in range(3))
def fb():
    out = fastattn.attention("linear", q, k, v)
    out.backward(g[0])
for f in (sums, fb): f(); f()
for name, f in (("three sums of 32 MiB", sums), ("linear fwd+bwd, registry", fb)):
    ts = []
    for _ in range(20):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    ts.sort(); print("%s: min %.2f ms, median %.2f ms" % (name, ts[0] * 1e3, ts[10] * 1e3))
