#!/usr/bin/env bash
# Helpers for what travels to the device machine between calls (it has no network, and one call
# carries at most 64 MiB).
#
#   bash bench/gpu/carry.sh OUTDIR SECTION
#
# Sections:
#   ficache   pack FlashInfer's JIT-compiled modules (built on first use, 20-100 s each) into
#             OUTDIR/fi-jit.txz; carry it back as .whl/fi-jit.txz and later machines load them
#             as AOT modules without a rebuild
#   ggufpart  join the default model's GGUF (98 MB) from two calls: carry
#             .gguf/smollm2.gguf.part-00 (+ smollm2.gguf.md5) in one call and
#             .gguf/smollm2.gguf.part-01 in the next, while the machine is still warm; each call
#             keeps its part in /tmp/gguf and the second joins them into /tmp/gguf/smollm2.gguf
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

case $section in
ficache)
  $py - "$out/fi-jit.txz" <<'PYEOF' 2>&1 | tee -a "$log"
import pathlib, sys, tarfile
sos = [p for p in pathlib.Path(".cache/fi").rglob("*.so") if p.parent.name == p.stem]
sos += [p for p in pathlib.Path("/tmp/fisite/flashinfer/data/aot").rglob("*.so")]
with tarfile.open(sys.argv[1], "w:xz", preset=6) as tar:
    for p in sos:
        print(p, p.stat().st_size)
        tar.add(p, arcname=f"{p.stem}/{p.name}")
print(sys.argv[1], pathlib.Path(sys.argv[1]).stat().st_size)
PYEOF
  ;;
ggufpart)
  mkdir -p /tmp/gguf && cp .gguf/smollm2.gguf.* /tmp/gguf/ 2>/dev/null
  if [ -f /tmp/gguf/smollm2.gguf.part-00 ] && [ -f /tmp/gguf/smollm2.gguf.part-01 ]; then
    cat /tmp/gguf/smollm2.gguf.part-0? > /tmp/gguf/smollm2.gguf
    echo "gguf joined: $(md5sum /tmp/gguf/smollm2.gguf | cut -d' ' -f1) (want $(cat /tmp/gguf/smollm2.gguf.md5))" | tee -a "$log"
  else
    ls /tmp/gguf | tee -a "$log"
  fi
  ;;
*)
  unknown_section
  ;;
esac
