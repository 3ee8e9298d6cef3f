"""specdec's native CPU kernels (C, AVX-512), built with the system's C compiler at first use (``build.py``).

``gemm.py``: a bf16 GEMM whose every output row is computed the same way whatever the number of rows in the call;
``attention.py``: paged attention with the same property for every query row. They are the batch-invariant CPU
path (``LLM(batch_invariant=...)``, docs/guarantees.md): a speculative verification window then computes, bit for
bit, what the decodes it replaces would compute. The quantised linears' kernels (w8a8, w4a8) live with the
quantisation code (``specdec/model/quant/native``) and use the same builder.
"""
