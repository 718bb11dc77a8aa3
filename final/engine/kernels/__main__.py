"""`python -m final.engine.kernels`: build and check the engine's kernel once (scripts/install.sh runs it, so a
first engine does not wait for gcc)."""

import logging

from final.engine.kernels import gemv_kernel

logging.basicConfig(level=logging.INFO)
kernel = gemv_kernel()
print(f"final GEMV kernel: {f'{kernel.path} ({kernel.isa})' if kernel else 'unavailable (torch kernels will be used)'}")
