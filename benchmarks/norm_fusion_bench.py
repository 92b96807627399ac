"""Where does the normalising decode linear lose time? Variants of one GEMV kernel timed as
decode_triton's "auto" times (graph replay over weight copies larger than L2)."""
import itertools, torch, triton, triton.language as tl
from dschat.engine import decode_triton as dt


@triton.jit
def _k(x_ptr, w_ptr, y_ptr, st_ptr, g_ptr, nb_ptr, mr_ptr, M, N, K, T, eps,
       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
       T_PAD: tl.constexpr, TILE: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if MODE == 1 or MODE == 2 or MODE == 4 or MODE == 5:
        mean, rstd = dt._norm_rows(st_ptr, offs_m, m_ok, M, T, K, eps, TILE, T_PAD, False)
    else:
        mean = tl.load(mr_ptr + offs_m * 2, mask=m_ok, other=0.0)
        rstd = tl.load(mr_ptr + offs_m * 2 + 1, mask=m_ok, other=1.0)
    if MODE == 7 or MODE == 8:     # x, g, nb read one iteration ahead (loop-carried registers)
        mean, rstd = dt._norm_rows(st_ptr, offs_m, m_ok, M, T, K, eps, TILE, T_PAD, False)
        k_ok = offs_k < K
        xn = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        gn = tl.load(g_ptr + offs_k, mask=k_ok, other=0.0)
        bn_ = tl.load(nb_ptr + offs_k, mask=k_ok, other=0.0)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            w = tl.load(w_ptr + offs_n[None, :] * K + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            xc, gc, bc = xn, gn, bn_
            k2 = k + BLOCK_K
            k2_ok = k2 < K
            xn = tl.load(x_ptr + offs_m[:, None] * K + k2[None, :], mask=m_ok[:, None] & k2_ok[None, :], other=0.0)
            gn = tl.load(g_ptr + k2, mask=k2_ok, other=0.0)
            bn_ = tl.load(nb_ptr + k2, mask=k2_ok, other=0.0)
            if MODE == 7:
                xc = ((xc.to(tl.float32) - mean[:, None]) * rstd[:, None] * gc.to(tl.float32)[None, :]
                      + bc.to(tl.float32)[None, :]).to(w.dtype)
            else:                  # RMS as HF: (x * rstd) rounded, then * g
                xc = ((xc.to(tl.float32) * rstd[:, None]).to(w.dtype).to(tl.float32)
                      * gc.to(tl.float32)[None, :]).to(w.dtype)
            acc += tl.dot(xc, w)
    for k0 in range(0, K if MODE < 7 else 0, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        w = tl.load(w_ptr + offs_n[None, :] * K + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if MODE == 1 or MODE == 3:
            g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            nb = tl.load(nb_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            x = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None] * g + nb).to(w.dtype)
        if MODE == 4:
            x = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None]).to(w.dtype)
        if MODE == 5:
            msk = m_ok[:, None] & k_ok[None, :]
            g = tl.load(g_ptr + offs_m[:, None] * 0 + k[None, :], mask=msk, other=0.0).to(tl.float32)
            nb = tl.load(nb_ptr + offs_m[:, None] * 0 + k[None, :], mask=msk, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None] * g + nb).to(w.dtype)
        if MODE == 6:
            x = (x.to(tl.float32) * 1.0001).to(w.dtype)
        acc += tl.dot(x, w)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def main():
    torch.manual_seed(0)
    dev = "cuda"
    M = 16
    names = {0: "plain", 1: "LN (current)", 2: "stats prologue, raw x", 3: "LN, no prologue",
             4: "prologue + row math only", 5: "LN, g/nb as 2-D tiles", 6: "x * const only",
             7: "LN, x/g/nb read ahead", 8: "RMS, x/g read ahead"}
    print("| shape | config | " + " | ".join(names.values()) + " |")
    print("|---" * (len(names) + 2) + "|")
    for N, K in [(12288, 4096), (16384, 4096), (3072, 1024)]:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        tile = 32
        T = K // tile
        xs = x.float().view(M, T, tile)
        st = torch.stack([xs.mean(-1), xs.var(-1, unbiased=False) * tile], -1).transpose(0, 1).contiguous()
        g, nb = torch.randn(K, device=dev, dtype=torch.bfloat16), torch.randn(K, device=dev, dtype=torch.bfloat16)
        mr = torch.stack([x.float().mean(-1), x.float().var(-1, unbiased=False).add(1e-5).rsqrt()], -1).contiguous()
        ref = torch.nn.functional.layer_norm(x, (K,), g, nb, 1e-5) @ w.t()
        copies, n_calls = dt._weight_copies(w)
        for bn, bk, nw, ns in [(32, 128, 4, 4), (64, 128, 4, 3), (32, 256, 4, 3), (32, 128, 4, 2), (64, 128, 8, 3)]:
            cells = []
            for mode in names:
                y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)

                def run(i, mode=mode, y=y):
                    _k[(triton.cdiv(N, bn),)](x, copies[i % len(copies)], y, st, g, nb, mr, M, N, K, T, 1e-5,
                                              BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, MODE=mode,
                                              T_PAD=triton.next_power_of_2(T), TILE=tile,
                                              num_warps=nw, num_stages=ns)
                try:
                    if N == 12288 and bn == 32 and bk == 128 and nw == 4:
                        h = _k[(triton.cdiv(N, bn),)](x, w, y, st, g, nb, mr, M, N, K, T, 1e-5,
                                                      BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, MODE=mode,
                                                      T_PAD=triton.next_power_of_2(T), TILE=tile,
                                                      num_warps=nw, num_stages=ns)
                        ptx = h.asm["ptx"]
                        print(f"mode {mode}: cp.async {ptx.count('cp.async.cg') + ptx.count('cp.async.ca')}, "
                              f"ld.global {ptx.count('ld.global')}, bar.sync {ptx.count('bar.sync')}, "
                              f"regs {h.n_regs}, smem {h.metadata.shared}", flush=True)
                    us = dt._graph_us(run, n_calls)
                    if mode in (1, 3, 5, 7):
                        run(0)
                        err = (y.float() - ref.float()).abs().max().item()
                        assert err < 0.5, err
                    cells.append(f"{us:.1f}")
                except Exception as exc:
                    cells.append(f"err {type(exc).__name__}")
            print(f"| {M}x{N}x{K} | n{bn} k{bk} w{nw} st{ns} | " + " | ".join(cells) + " |", flush=True)
        print(f"floor at 4.2 TB/s: {N * K * 2 / 4.2e6:.1f} us")


if __name__ == "__main__":
    main()
