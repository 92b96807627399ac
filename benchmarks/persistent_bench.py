"""Would one persistent kernel per layer beat one kernel per op? A test of that before it is built.

A bloom-7b1 decode step runs 7 kernels a layer. Each loses about 3 us to its ramp and tail
(docs/DECODE.md, section 8). The other fixes were measured and dropped: fusing the norms
into the linears, L2 warming, a work queue, a tile-major weight layout. A persistent
per-layer kernel is the one left. It runs the layer's phases in one launch, separated by
grid barriers, and while a program waits at a barrier it can already ask L2 for its next
weights. This script times that at its simplest, a chain of the layer's four GEMVs per layer
(x @ Wqkv, then dense, fc1, fc2, at bloom-7b1's shapes, batch 16, distinct weights per layer):

- `kernels`: one launch per GEMV with programmatic dependent launch (PDL), as the decode
  step launches them, with the same L2 prefetch of each program's first weight bytes;
- `persistent`: the same GEMV code in one launch for all layers, a grid barrier (atomic
  arrival counter, acquire/release at GPU scope) between GEMVs, prefetching the next phase's
  first bytes before it waits;
- for reference, the decode step's own linear kernels (`decode_triton`) in the same chain,
  the output projections as split-K partials without the add+norm that sums them.

Every mode is checked against torch (fp32 of the same bf16 inputs), then timed replayed
from a CUDA graph.

    python benchmarks/persistent_bench.py [--layers 4] [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/persistent_bench.py --smoke    # tiny shapes on CPU

In Triton's interpreter, programs run one after another, so a grid barrier could never be
met. There `persistent` runs with a single program, which meets each barrier alone.
"""
from __future__ import annotations

import argparse
import os

import torch

from benchmarks.attn_bench import write_sweep
from dschat.engine import decode_triton as dt

triton, tl = dt.triton, getattr(dt, "tl", None)

if triton is not None:

    @triton.jit
    def _gemv_phase(x_ptr, sx, w_ptr, y_ptr, M, N, K, pid, n_prog, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, CG: tl.constexpr):
        """y[:M, tiles] = x @ w[tiles].T (fp32 accumulation) for the column tiles pid,
        pid + n_prog, ... of w [N, K] (N a multiple of BLOCK_N, K of BLOCK_K). CG: read x
        through L2 only (another program of this launch wrote it)."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m[:, None] < M
        for t in range(pid, N // BLOCK_N, n_prog):
            offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None])
                if CG:
                    x = tl.load(x_ptr + offs_m[:, None] * sx + k[None, :], mask=m_ok, other=0.0, cache_modifier=".cg")
                else:
                    x = tl.load(x_ptr + offs_m[:, None] * sx + k[None, :], mask=m_ok, other=0.0)
                acc = acc + tl.dot(x, w)
            tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok)

    @triton.jit
    def _prefetch_first(w_ptr, N, K, pid, BLOCK_N: tl.constexpr, PF_K: tl.constexpr, LINE: tl.constexpr):
        """Ask L2 for the first PF_K columns of this program's first tile of w [N, K] (rows
        clamped into w: a program without a tile in this phase asks for its last row)."""
        if PF_K > 0:
            rows = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
            dt._l2_prefetch_rows(w_ptr, rows, K, 0, K, PF_K, LINE)

    @triton.jit
    def _grid_barrier(cnt_ptr, target):
        """Wait until every program of the grid has arrived (the counter reaches target)."""
        tl.debug_barrier()                                    # this program's stores are issued
        seen = tl.atomic_add(cnt_ptr, 1, sem="release") + 1
        while seen < target:
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire")
        tl.debug_barrier()

    @triton.jit
    def _phase(j, l, h_ptr, wq, wd, w1, w2, hq, hd, h1, pid, n_prog, M, NQ, D, NF,
               BLOCK_M: tl.constexpr, BN_Q: tl.constexpr, BN_D: tl.constexpr, BN_1: tl.constexpr,
               BN_2: tl.constexpr, BLOCK_K: tl.constexpr, CG: tl.constexpr):
        """Phase j of layer l: 0 h -> hq (QKV), 1 hq[:, :D] -> hd (dense), 2 hd -> h1 (fc1),
        3 h1 -> h (fc2, the next layer's input)."""
        l64 = tl.zeros([], tl.int64) + l              # weight offsets past 2**31 elements
        if j == 0:
            _gemv_phase(h_ptr, D, wq + l64 * NQ * D, hq, M, NQ, D, pid, n_prog, BLOCK_M, BN_Q,
                        BLOCK_K, CG)
        elif j == 1:
            _gemv_phase(hq, NQ, wd + l64 * D * D, hd, M, D, D, pid, n_prog, BLOCK_M, BN_D, BLOCK_K, CG)
        elif j == 2:
            _gemv_phase(hd, D, w1 + l64 * NF * D, h1, M, NF, D, pid, n_prog, BLOCK_M, BN_1, BLOCK_K, CG)
        else:
            _gemv_phase(h1, NF, w2 + l64 * D * NF, h_ptr, M, D, NF, pid, n_prog, BLOCK_M, BN_2,
                        BLOCK_K, CG)

    @triton.jit
    def _next_weights(j, l, wq, wd, w1, w2, NQ, D, NF, pid, BN_Q: tl.constexpr, BN_D: tl.constexpr,
                      BN_1: tl.constexpr, BN_2: tl.constexpr, PF: tl.constexpr, LINE: tl.constexpr):
        """L2 prefetch of this program's first bytes of phase j of layer l (PF bytes of bf16)."""
        l64 = tl.zeros([], tl.int64) + l
        if j == 0:
            _prefetch_first(wq + l64 * NQ * D, NQ, D, pid, BN_Q, PF // (2 * BN_Q), LINE)
        elif j == 1:
            _prefetch_first(wd + l64 * D * D, D, D, pid, BN_D, PF // (2 * BN_D), LINE)
        elif j == 2:
            _prefetch_first(w1 + l64 * NF * D, NF, D, pid, BN_1, PF // (2 * BN_1), LINE)
        else:
            _prefetch_first(w2 + l64 * D * NF, D, NF, pid, BN_2, PF // (2 * BN_2), LINE)

    @triton.jit
    def _chain_kernel(h_ptr, wq, wd, w1, w2, hq, hd, h1, cnt_ptr, layer, j_one, n_layers, M, NQ, D, NF,
                      BLOCK_M: tl.constexpr, BN_Q: tl.constexpr, BN_D: tl.constexpr, BN_1: tl.constexpr,
                      BN_2: tl.constexpr, BLOCK_K: tl.constexpr, PERSISTENT: tl.constexpr, PDL: tl.constexpr,
                      PF: tl.constexpr, LINE: tl.constexpr):
        """PERSISTENT: every phase of n_layers layers, a grid barrier between phases; else
        phase j_one of `layer` only (one launch per GEMV)."""
        pid = tl.program_id(0)
        n_prog = tl.num_programs(0)
        if PERSISTENT:
            _next_weights(0, 0, wq, wd, w1, w2, NQ, D, NF, pid, BN_Q, BN_D, BN_1, BN_2, PF, LINE)
            dt._pdl_enter(PDL)
            n_phase = 0
            for l in range(0, n_layers):
                for j in range(0, 4):
                    _phase(j, l, h_ptr, wq, wd, w1, w2, hq, hd, h1, pid, n_prog, M, NQ, D, NF, BLOCK_M,
                           BN_Q, BN_D, BN_1, BN_2, BLOCK_K, True)
                    n_phase += 1
                    if n_phase < 4 * n_layers:
                        nl = l + (j + 1) // 4
                        _next_weights((j + 1) % 4, nl, wq, wd, w1, w2, NQ, D, NF, pid, BN_Q, BN_D, BN_1, BN_2,
                                      PF, LINE)
                        _grid_barrier(cnt_ptr, n_phase * n_prog)
            # the last program out re-arms the counters (nobody waits on them any more)
            tl.debug_barrier()
            if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel") == n_prog - 1:
                tl.atomic_xchg(cnt_ptr, 0)
                tl.atomic_xchg(cnt_ptr + 1, 0)
        else:
            _next_weights(j_one, layer, wq, wd, w1, w2, NQ, D, NF, pid, BN_Q, BN_D, BN_1, BN_2, PF, LINE)
            dt._pdl_enter(PDL)
            _phase(j_one, layer, h_ptr, wq, wd, w1, w2, hq, hd, h1, pid, n_prog, M, NQ, D, NF, BLOCK_M,
                   BN_Q, BN_D, BN_1, BN_2, BLOCK_K, False)


class Chain:
    """bf16 weights of n_layers layers at one shape, the activations, and the three ways to run them."""

    def __init__(self, n_layers: int, D: int, NQ: int, NF: int, M: int, dev, dtype, bns=(32, 32, 64, 16), bk=128):
        g = torch.Generator(device=dev).manual_seed(0)
        w = lambda n, k: (torch.randn(n_layers, n, k, device=dev, generator=g) / k ** 0.5).to(dtype)  # noqa: E731
        self.wq, self.wd, self.w1, self.w2 = w(NQ, D), w(D, D), w(NF, D), w(D, NF)
        self.x = torch.randn(M, D, device=dev, generator=g).to(dtype)
        self.h = torch.empty(M, D, device=dev, dtype=dtype)
        self.hq, self.hd, self.h1 = (torch.empty(M, n, device=dev, dtype=dtype) for n in (NQ, D, NF))
        self.cnt = torch.zeros(2, dtype=torch.int32, device=dev)
        self.n_layers, self.D, self.NQ, self.NF, self.M = n_layers, D, NQ, NF, M
        self.bns, self.bk = bns, bk
        self.line = 128 // self.x.element_size()

    def reference(self):
        h = self.x.float()
        for l in range(self.n_layers):
            hq = (h @ self.wq[l].float().t()).to(self.x.dtype).float()
            hd = (hq[:, :self.D] @ self.wd[l].float().t()).to(self.x.dtype).float()
            h1 = (hd @ self.w1[l].float().t()).to(self.x.dtype).float()
            h = (h1 @ self.w2[l].float().t()).to(self.x.dtype).float()
        return h

    def _args(self, persistent: bool, layer=0, j=0, warps=4, pf=None):
        pdl = dt._pdl_mode(self.x.device)
        pf = (dt.options().pdl_prefetch if pdl == 3 else 0) if pf is None else pf
        bq, bd, b1, b2 = self.bns
        return ((self.h, self.wq, self.wd, self.w1, self.w2, self.hq, self.hd, self.h1, self.cnt,
                 layer, j, self.n_layers, self.M, self.NQ, self.D, self.NF),
                dict(BLOCK_M=max(16, triton.next_power_of_2(self.M)), BN_Q=bq, BN_D=bd, BN_1=b1, BN_2=b2,
                     BLOCK_K=self.bk, PERSISTENT=persistent, PDL=pdl, PF=pf, LINE=self.line, num_warps=warps,
                     **dt._pdl_launch(pdl)))

    def _launch(self, grid, persistent: bool, layer=0, j=0, pf=None):
        args, kwargs = self._args(persistent, layer, j, pf=pf)
        _chain_kernel[(grid,)](*args, **kwargs)

    def programs_per_sm(self) -> int:
        """How many programs of the persistent kernel an SM holds at once (shared memory and
        registers of the compiled kernel; compiled, not launched)."""
        args, kwargs = self._args(True, pf=32768)
        k = _chain_kernel.warmup(*args, grid=(1,), **kwargs)
        k._init_handles()
        props = torch.cuda.get_device_properties(self.x.device)
        smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        threads = 32 * kwargs["num_warps"]
        by_smem = smem // max(k.metadata.shared + 1024, 1)          # + the per-block reservation
        by_regs = 65536 // (max(k.n_regs, 1) * threads)
        print(f"persistent kernel: {k.metadata.shared} B shared, {k.n_regs} registers, {k.n_spills} spills",
              flush=True)
        return max(0, min(by_smem, by_regs, 2048 // threads))

    def kernels(self, pf=None):
        """One launch per GEMV, each over all of its column tiles."""
        self.h.copy_(self.x)
        for l in range(self.n_layers):
            for j, n in enumerate((self.NQ, self.D, self.NF, self.D)):
                self._launch(n // self.bns[j], False, l, j, pf=pf)
        return self.h

    def persistent(self, programs: int, pf=None):
        self.h.copy_(self.x)
        self._launch(programs, True, pf=pf)
        return self.h

    def decode_kernels(self):
        """The decode step's own linear kernels in the same chain (split-K partials summed by torch)."""
        h = self.x
        for l in range(self.n_layers):
            hq = dt._linear_triton(h, self.wq[l], None, False, 32, 128, 4, 4)
            hd = dt._linear_parts(hq[:, :self.D], self.wd[l], 4, 64, 128).sum(0).to(h.dtype)
            h1 = dt._linear_triton(hd, self.w1[l], None, False, 64, 128)
            h = dt._linear_parts(h1, self.w2[l], 4, 64, 128).sum(0).to(h.dtype)
        return h


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layers", type=int, default=4, help="Layers of distinct weights per chain (400 MB each).")
    ap.add_argument("--smoke", action="store_true", help="Tiny shapes on CPU (TRITON_INTERPRET=1): checks only.")
    args = ap.parse_args()
    gpu = not args.smoke
    dev = torch.device("cuda" if gpu else "cpu")
    if gpu:
        chain = Chain(args.layers, 4096, 12288, 16384, 16, dev, torch.bfloat16)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
    else:
        chain = Chain(2, 64, 96, 128, 3, dev, torch.float32, bns=(16, 16, 32, 16), bk=32)
        sms = 1
    ref = chain.reference()
    per_layer_mb = sum(t[0].numel() * t.element_size() for t in (chain.wq, chain.wd, chain.w1, chain.w2)) / 1e6
    modes = [("kernels (PDL, 8 KiB L2 prefetch)", lambda: chain.kernels()),
             ("kernels (PDL, no prefetch)", lambda: chain.kernels(pf=0))]
    # a grid barrier needs every program resident at once: no more per SM than fit
    try:
        fit = chain.programs_per_sm() if gpu else 1
    except Exception as exc:      # Triton's compiled-kernel internals moved: one per SM always fits
        print(f"programs per SM unknown ({type(exc).__name__}: {exc}); persistent runs at 1 per SM", flush=True)
        fit = 1
    for per_sm in (1, 2, 3) if gpu else (1,):
        if per_sm > fit:
            print(f"persistent {per_sm}/SM: skipped, {fit} programs fit on an SM", flush=True)
            continue
        for pf in (0, 8192, 32768) if gpu else (0,):     # (the interpreter has no inline PTX)
            modes.append((f"persistent {per_sm}/SM, {pf // 1024} KiB prefetch at each barrier",
                          lambda n=per_sm * sms, pf=pf: chain.persistent(n, pf)))
    if gpu:
        modes.append(("decode_triton's linears", chain.decode_kernels))
    rows = []
    for label, fn in modes:
        try:
            err = (fn().float() - ref).abs().max().item() / ref.abs().max().item()
            if gpu:
                us = dt._graph_us(lambda i: fn(), 3) / args.layers
            else:
                us = float("nan")
        except Exception as exc:         # a configuration Triton cannot compile
            print(f"{label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        assert chain.cnt.tolist() == [0, 0], ("counters not re-armed", label, chain.cnt.tolist())
        rows.append(dict(shape=f"bloom-7b1 layer GEMVs ({per_layer_mb:.0f} MB)", rows=chain.M, variant=label,
                         us=us, tb_s=per_layer_mb / us if us == us else 0.0, err=err))
        print(f"{label}: {us:.1f} us per layer ({rows[-1]['tb_s']:.2f} TB/s), rel err {err:.1e}", flush=True)
    write_sweep(args.out, "persistent", "a layer's GEMVs: one kernel each vs one persistent kernel", "rows", "TB/s",
                "max rel diff to torch", rows)


if __name__ == "__main__":
    main()
