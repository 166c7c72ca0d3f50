#!/usr/bin/env bash
# Debian's ip and tc, with the libraries they need, in .whl/iproute2/ for a machine that
# has no iproute2 (the GPU machine of scripts/device_check.sh): virtual clusters need
# both. Each command is a wrapper that runs the binary with the machine's own loader and
# these libraries (--library-path), so a command that ip starts (ip netns exec python ...)
# does not inherit them.   Usage: bash scripts/iproute2_bundle.sh   (here, where ip works)
set -euo pipefail
out=${1:-.whl/iproute2}
rm -rf "$out"; mkdir -p "$out/bin" "$out/lib"
for tool in ip tc; do
  real=$(command -v "$tool") || { echo "iproute2_bundle.sh: no $tool here (apt-get install iproute2)" >&2; exit 1; }
  cp "$real" "$out/bin/$tool.real"
  ldd "$real" | awk '/=>/ {print $3}' | grep -v -e '/libc\.so' -e '/libm\.so' | xargs -r cp -Lt "$out/lib"
  cat > "$out/bin/$tool" <<WRAP
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")
exec /lib64/ld-linux-x86-64.so.2 --library-path "\$here/../lib" "\$here/$tool.real" "\$@"
WRAP
  chmod +x "$out/bin/$tool"
done
"$out/bin/ip" -V
