"""The error of each cache format against bf16 exact attention (docs/decode.md):
.venv/bin/python tests/kvcache/kv_error_table.py  (CPU, ~30 s). Random normal K, V, q; B=4 ragged,
Hkv=8, gqa 8, D=128, Sq=1, paged(page_size=64); rel-L2 of O per sequence, max |LSE error|."""
import torch, fp4gen
from fp4gen.frontend import parse_text
from fp4gen.numerics import exact
g = torch.Generator().manual_seed(0)
B, S, Hkv, D, G = 4, 4096, 8, 128, 8
K = torch.randn(B, S, Hkv, D, generator=g).bfloat16(); V = torch.randn(B, S, Hkv, D, generator=g).bfloat16()
q = torch.randn(B, 1, Hkv * G, D, generator=g).bfloat16()
lens = torch.tensor([4096, 3000, 1000, 17], dtype=torch.int32)
ref = [exact.attention(q[b:b+1], K[b:b+1, :L], V[b:b+1, :L], scale=D ** -0.5) for b, L in enumerate(lens.tolist())]
for fmt in ["bf16", "fp8e4m3(scale=token)", "fp8e4m3(scale=tensor)", "nvfp4", "nvfp4(tensor_scale=fp32)"]:
    spec = parse_text(f"attention e {{\n target reference\n head_dim {D}\n kv_cache {{\n storage paged(page_size=64)\n format {fmt}\n gqa {G}\n }}\n}}\n")[0]
    kc, vc, pt = fp4gen.kv_cache_from(K, V, spec, cache_seqlens=lens)
    o, lse = fp4gen.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=pt, spec=spec, return_lse=True)
    e = [((o[b:b+1].double() - oe).norm() / oe.norm()).item() for b, (oe, _) in enumerate(ref)]
    el = max((lse[b].double() - le[0]).abs().max().item() for b, (_, le) in enumerate(ref))
    print(f"| {fmt} | {kc.fmt.bytes_per_token(D) * 2:g} | " + " / ".join(f"{x:.2e}" for x in e) + f" | {el:.1e} |")
