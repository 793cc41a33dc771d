#!/usr/bin/env bash
# Run the fabric's RDMA transport contract (cache-fabric/tests/transport.rs, feature rdma)
# and its in-process cluster tests (cache-fabric/tests/cluster.rs) over a real RDMA device: soft-RoCE (rdma_rxe) inside a small virtual machine, because the
# build machines' own kernel has no RDMA support at all (ENOSYS).
#
# What it does:
#   1. builds the transport test binary with the rdma feature;
#   2. fetches a Debian kernel package (it ships rdma_rxe as a module) and takes the kernel
#      and the modules rxe needs (dependencies read from each module's modinfo);
#   3. packs an initramfs: static busybox, the test binaries and their shared libraries,
#      libibverbs' rxe provider, iproute2's `rdma` tool, and an init script;
#   4. boots it in QEMU (KVM when /dev/kvm is usable, else emulation); the init script loads
#      the modules, creates rxe0 on a dummy Ethernet device, runs both test binaries with
#      CACHET_RDMA_DEVICE=rxe0 and powers off;
#   5. exits non-zero if either failed.
#
# Needs (installed when missing, Debian): qemu-system-x86, busybox-static, rdma-core,
# ibverbs-providers, iproute2, plus what the rdma feature's build needs (cmake,
# libclang-dev, libibverbs-dev).
# Usage: scripts/rdma-vm.sh [extra test-binary arguments, e.g. a test name filter]
# CACHET_RDMA_VM_BENCH=path/to/cachet (a build with --features rdma) also runs
# `cachet loadtest transfer --rdma-device rxe0` in the machine (a functional check of the
# benchmark's RDMA row: emulated soft-RoCE says nothing of real throughput).
set -euo pipefail
cd "$(dirname "$0")/.."

work=${CACHET_RDMA_VM_DIR:-$PWD/.cachet/rdma-vm}
mkdir -p "$work"

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
[ -x /bin/busybox ] && file -L /bin/busybox 2>/dev/null | grep -q "statically linked" || need+=(busybox-static)
command -v rdma >/dev/null || need+=(iproute2)
[ -e /etc/libibverbs.d/rxe.driver ] || need+=(ibverbs-providers rdma-core)
command -v file >/dev/null || need+=(file)
command -v cpio >/dev/null || need+=(cpio)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

echo "== building the transport contract and cluster tests with the rdma feature"
# CACHET_RDMA_TEST_BINS: the test binaries to run, already built (space-separated).
# Built with the features `make rust-test` builds the fabric's feature tests with (cuda and
# rdma: CUDA is loaded at run time, never linked), so the transport binary and the crate are
# built once for both; nothing here touches a GPU.
bins=${CACHET_RDMA_TEST_BINS:-}
[ -n "$bins" ] || bins=$(cargo test -p cache-fabric --features cuda,rdma --locked --test transport \
        --test cluster --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"] in ("transport","cluster"):
        print(m["executable"])' | sort -u | tr '\n' ' ')
for b in $bins; do [ -x "$b" ] || { echo "could not build the RDMA test binaries" >&2; exit 1; }; done
[ "$(echo $bins | wc -w)" -eq 2 ] || { echo "could not build the RDMA test binaries" >&2; exit 1; }

echo "== kernel with rdma_rxe"
kdeb=$(ls "$work"/linux-image-*-amd64_*.deb 2>/dev/null | head -1 || true)
if [ -z "$kdeb" ]; then
  pkg=$(apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1)
  [ -n "$pkg" ] || { apt-get update -qq; pkg=$(apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1); }
  (cd "$work" && apt-get download "$pkg" >/dev/null 2>&1)
  kdeb=$(ls "$work"/linux-image-*-amd64_*.deb | head -1)
fi
rm -rf "$work/kernel" && mkdir -p "$work/kernel"
dpkg-deb -x "$kdeb" "$work/kernel"
kver=$(ls "$work/kernel/lib/modules" | head -1)
vmlinuz="$work/kernel/boot/vmlinuz-$kver"
moddir="$work/kernel/lib/modules/$kver"

root="$work/root"
rm -rf "$root" && mkdir -p "$root"/{bin,dev,proc,sys,tmp,lib/modules,etc/libibverbs.d,lib64}
cp /bin/busybox "$root/bin/busybox"

# Modules in load order: each after its dependencies (modinfo "depends=").
# rxe checksums packets with the crypto API's "crc32" (crc32_generic).
python3 - "$moddir" "$root/lib/modules" dummy crc32_generic rdma_rxe <<'EOF'
import os, re, shutil, sys
moddir, out, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
paths = {}
for d, _, files in os.walk(moddir):
    for f in files:
        if f.endswith(".ko"):
            paths[f[:-3].replace("-", "_")] = os.path.join(d, f)
order = []
def visit(name):
    name = name.replace("-", "_")
    if name in order:
        return
    data = open(paths[name], "rb").read()
    m = re.search(rb"depends=([^\0]*)\0", data)
    for dep in filter(None, (m.group(1).decode() if m else "").split(",")):
        visit(dep)
    order.append(name)
for w in wanted:
    visit(w)
with open(os.path.join(out, "order"), "w") as f:
    for i, name in enumerate(order):
        shutil.copy(paths[name], os.path.join(out, f"{i:02d}-{name}.ko"))
        f.write(f"{i:02d}-{name}.ko\n")
print("modules:", " ".join(order))
EOF

# Shared libraries of the test binary and the rdma tool, and the rxe provider.
provider=$(ls /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so | head -1)
for b in $bins; do cp "$b" "$root/bin/$(basename "$b" | sed 's/-[0-9a-f]*$//')-tests"; done
cp "$(command -v rdma)" "$root/bin/rdma"
cp /etc/libibverbs.d/rxe.driver "$root/etc/libibverbs.d/"
mkdir -p "$root/usr/lib/x86_64-linux-gnu/libibverbs"
cp "$provider" "$root/usr/lib/x86_64-linux-gnu/libibverbs/"
bench=${CACHET_RDMA_VM_BENCH:-}
[ -z "$bench" ] || cp "$bench" "$root/bin/cachet"
for f in $bins $bench "$(command -v rdma)" "$provider"; do
  ldd "$f" | awk '/=> \//{print $3} /^\s*\/lib64/{print $1}'
done | sort -u | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
[ -e "$root/lib64/ld-linux-x86-64.so.2" ] || cp -L /lib64/ld-linux-x86-64.so.2 "$root/lib64/"

test_args="$*"
# The device the tests use (CACHET_RDMA_VM_DEVICE= runs them without RDMA, for comparison).
device=${CACHET_RDMA_VM_DEVICE-rxe0}
cat > "$root/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
for m in \$(cat /lib/modules/order); do insmod /lib/modules/\$m || echo "insmod \$m failed"; done
ip link set lo up
ip link add rdma0 type dummy
ip addr add 10.77.0.1/24 dev rdma0
ip link set rdma0 up
rdma link add rxe0 type rxe netdev rdma0 || echo "rdma link add failed"
rdma link show
ulimit -l unlimited
cd /tmp
status=0
for t in /bin/transport-tests /bin/cluster-tests; do
  CACHET_RDMA_DEVICE=$device RUST_BACKTRACE=1 \$t --test-threads=1 $test_args || status=\$?
done
if [ -x /bin/cachet ]; then
  /bin/cachet loadtest transfer --size-mib 8 --iterations 5 --stripes 1 --redis-url "" --rdma-device $device || status=1
fi
echo "CACHET_RDMA_VM_STATUS=\$status"
poweroff -f
EOF
chmod +x "$root/init"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$work/initrd.gz"

# Emulated, not KVM: the build machines are virtual machines themselves, and a nested KVM
# guest there stalls at boot; emulation boots this kernel in a few seconds.
accel=(-machine accel=tcg -cpu max)
echo "== booting $kver (emulated)"
log="$work/console.log"
timeout 600 qemu-system-x86_64 "${accel[@]}" -m 2048 -smp 2 -nographic -no-reboot \
  -nic none -kernel "$vmlinuz" -initrd "$work/initrd.gz" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1" | tee "$log"
status=$(sed -n 's/.*CACHET_RDMA_VM_STATUS=\([0-9]*\).*/\1/p' "$log" | tail -1)
[ -n "$status" ] || { echo "the virtual machine ended without a test status" >&2; exit 1; }
exit "$status"
