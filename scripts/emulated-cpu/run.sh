#!/usr/bin/env bash
# Run a static x86-64 Linux executable on an *emulated* CPU with AVX-512 +
# AVX512-VNNI (Bochs 2.7, CPU model "tigerlake"), inside a minimal Linux guest.
#
#   scripts/emulated-cpu/run.sh BINARY [ARGS...]
#   scripts/emulated-cpu/run.sh --setup        # install packages + build cache only
#
# The guest prints its /proc/cpuinfo flags, runs BINARY with ARGS in /work,
# prints "EMULATED-EXIT <rc>" and powers off.  This script exits with <rc>
# (125 if the guest never reported an exit status, 124 on timeout).
#
# Environment knobs (all optional):
#   EMU_MODEL=tigerlake        Bochs CPU model (corei7_icelake_u also works)
#   EMU_MEGS=2048              guest RAM in MiB
#   EMU_IPS=...                Bochs "ips" (guest instructions per guest second);
#                              only affects the guest clock, not the speed
#   EMU_TIMEOUT=7200           wall-clock limit in seconds (0 = none)
#   EMU_ENV="A=1 B"            environment for BINARY; a bare NAME copies the
#                              host value.  RUST_BACKTRACE / RUST_TEST_THREADS /
#                              RUST_MIN_STACK / RUST_LOG are forwarded if set.
#   EMU_FILES="f1 dir2"        extra files/dirs copied into the guest's /work
#   EMU_VERBOSE=1              show the kernel boot log
#   EMU_KARGS="..."            extra kernel command-line arguments
#   EMU_KEEP=1                 keep the per-run work dir (serial.log, bochs.log)
#   EMU_CACHE=~/.cache/specdec-emulated
set -euo pipefail

CACHE=${EMU_CACHE:-$HOME/.cache/specdec-emulated}
MODEL=${EMU_MODEL:-tigerlake}
MEGS=${EMU_MEGS:-2048}
IPS=${EMU_IPS:-25000000}
TIMEOUT=${EMU_TIMEOUT:-7200}
VERBOSE=${EMU_VERBOSE:-0}

# Kernel command line.  The clearcpuid= list works around Bochs 2.7 bugs in the
# Tiger Lake / Ice Lake models (see README.md):
#   fsrm             - kernel's FSRM "rep movsb" memmove path corrupts kernel
#                      text under Bochs -> page-fault storm at "LSM: ..."
#   xsaves,xsavec    - CPUID.(0xD,1).EBX reports the standard, not the
#                      compacted, XSAVE size -> kernel disables XSAVE (no AVX)
#   pku,ospke        - CPUID.(0xD,9) (PKRU state) is all-zero -> same
# cryptomgr.notests skips the crypto self-tests (~10 s of emulated boot time).
KCMDLINE="console=ttyS0,115200 mitigations=off nokaslr cryptomgr.notests clearcpuid=fsrm,xsaves,xsavec,pku,ospke"
[ "$VERBOSE" = 1 ] || KCMDLINE="$KCMDLINE quiet loglevel=1"
KCMDLINE="$KCMDLINE ${EMU_KARGS:-}"

APT_PKGS="bochs bochsbios vgabios busybox-static xorriso isolinux syslinux-common cpio"

log() { echo "[emulated-cpu] $*" >&2; }

setup() {
    local missing=()
    for p in $APT_PKGS; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    mkdir -p "$CACHE"
    if [ ! -s "$CACHE/vmlinuz" ]; then
        # Debian's cloud kernel: LZ4-compressed (fast to decompress when
        # emulated), has 8250 serial console + initramfs support built in.
        local kpkg tmp
        kpkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
        [ -n "$kpkg" ] || { apt-get update -qq; kpkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}'); }
        log "fetching kernel $kpkg"
        tmp=$(mktemp -d /tmp/emulated-cpu-kernel.XXXXXX)
        (cd "$tmp" && apt-get download -qq "$kpkg" 2>/dev/null && dpkg -x ./*.deb x)
        cp "$tmp"/x/boot/vmlinuz-* "$CACHE/vmlinuz.tmp.$$" && mv "$CACHE/vmlinuz.tmp.$$" "$CACHE/vmlinuz"
        echo "$kpkg" > "$CACHE/kernel-version"
        rm -rf "$tmp"
    fi
    [ -s "$CACHE/isolinux.bin" ] || cp /usr/lib/ISOLINUX/isolinux.bin "$CACHE/"
    [ -s "$CACHE/ldlinux.c32" ] || cp /usr/lib/syslinux/modules/bios/ldlinux.c32 "$CACHE/"
    if [ ! -s "$CACHE/base.cpio" ] || [ "$0" -nt "$CACHE/base.cpio" ]; then
        build_base_cpio
    fi
}

# Base initramfs: busybox + /init.  The per-run program is appended as a
# second cpio archive (the kernel unpacks concatenated archives in order).
build_base_cpio() {
    local rd
    rd=$(mktemp -d /tmp/emulated-cpu-rd.XXXXXX)
    mkdir -p "$rd"/{bin,proc,sys,dev,tmp,work,etc}
    cp /bin/busybox "$rd/bin/busybox"
    cat > "$rd/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin HOME=/tmp TMPDIR=/tmp
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/shm /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
echo "EMULATED-CPU: $(grep -m1 '^model name' /proc/cpuinfo | sed 's/.*: //'), $(grep -c ^processor /proc/cpuinfo) cpu(s), $(grep MemTotal /proc/meminfo | tr -s ' ')"
echo "EMULATED-FLAGS: $(grep -m1 '^flags' /proc/cpuinfo | sed 's/^flags[[:space:]]*: //')"
echo "EMULATED-START $(cut -d' ' -f1 /proc/uptime)"
cd /work
set --
[ -f /run.args ] && . /run.args
/work/prog "$@"
rc=$?
echo "EMULATED-EXIT $rc"
# let the UART drain before powering off (guest idle time is cheap in Bochs)
sleep 1
poweroff -f
EOF
    chmod 755 "$rd/init"
    (cd "$rd" && find . | LC_ALL=C sort | cpio -o -H newc --quiet) > "$CACHE/base.cpio.tmp.$$"
    mv "$CACHE/base.cpio.tmp.$$" "$CACHE/base.cpio"
    rm -rf "$rd"
}

shq() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }

if [ "${1:-}" = "--setup" ]; then setup; log "cache ready in $CACHE"; exit 0; fi
if [ $# -lt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 2
fi
BIN=$1; shift
[ -f "$BIN" ] || { log "no such file: $BIN"; exit 2; }
if file -L "$BIN" 2>/dev/null | grep -q 'dynamically linked'; then
    log "warning: $BIN is dynamically linked; the guest has no shared libraries (build with RUSTFLAGS='-C target-feature=+crt-static')"
fi

setup

WORK=$(mktemp -d /tmp/emulated-cpu.XXXXXX)
BOCHS_PID=
cleanup() {
    [ -n "$BOCHS_PID" ] && kill "$BOCHS_PID" 2>/dev/null || true
    if [ "${EMU_KEEP:-0}" = 1 ]; then log "work dir kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- per-run initramfs: the program, its arguments, environment, extra files
mkdir -p "$WORK/rd/work" "$WORK/iso"
cp "$BIN" "$WORK/rd/work/prog"; chmod 755 "$WORK/rd/work/prog"
{
    for v in RUST_BACKTRACE RUST_TEST_THREADS RUST_MIN_STACK RUST_LOG; do
        [ -n "${!v:-}" ] && echo "export $v=$(shq "${!v}")"
    done
    for kv in ${EMU_ENV:-}; do
        if [[ "$kv" == *=* ]]; then echo "export ${kv%%=*}=$(shq "${kv#*=}")"
        else echo "export $kv=$(shq "${!kv:-}")"; fi
    done
    printf 'set --'; for a in "$@"; do printf ' %s' "$(shq "$a")"; done; echo
} > "$WORK/rd/run.args"
for f in ${EMU_FILES:-}; do cp -a "$f" "$WORK/rd/work/"; done
(cd "$WORK/rd" && find . | LC_ALL=C sort | cpio -o -H newc --quiet) > "$WORK/prog.cpio"
cat "$CACHE/base.cpio" "$WORK/prog.cpio" > "$WORK/iso/initrd.img"
rm -rf "$WORK/rd" "$WORK/prog.cpio"

ln -s "$CACHE/vmlinuz" "$WORK/iso/vmlinuz"
cp "$CACHE/isolinux.bin" "$CACHE/ldlinux.c32" "$WORK/iso/"
cat > "$WORK/iso/isolinux.cfg" <<EOF
DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL /vmlinuz
  INITRD /initrd.img
  APPEND $KCMDLINE
EOF
xorriso -as mkisofs -quiet -follow-links -o "$WORK/boot.iso" -b isolinux.bin -c boot.cat \
    -no-emul-boot -boot-load-size 4 -boot-info-table "$WORK/iso" 2>/dev/null
rm -rf "$WORK/iso"

# --- Bochs configuration
cat > "$WORK/bochsrc" <<EOF
# Debian's bochs has no 'nogui'; rfb with timeout=0 never waits for a client.
display_library: rfb, options="timeout=0"
memory: guest=$MEGS, host=$MEGS
cpu: model=$MODEL, count=1, ips=$IPS, reset_on_triple_fault=0, ignore_bad_msrs=1
clock: sync=none, time0=local
romimage: file=/usr/share/bochs/BIOS-bochs-latest
vgaromimage: file=/usr/share/bochs/VGABIOS-lgpl-latest
ata0: enabled=1, ioaddr1=0x1f0, ioaddr2=0x3f0, irq=14
ata0-master: type=cdrom, path=$WORK/boot.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=$WORK/serial.log
log: $WORK/bochs.log
panic: action=fatal
error: action=report
info: action=ignore
debug: action=ignore
# Without it Debian's bochs 2.7 loads its ALSA sound plugin, which aborts the emulator at start
# ('buffer overflow detected') on a machine with no sound device configured (seen at stop 57).
sound: driver=dummy
EOF
# Debian's bochs is built with the internal debugger, which stops before the
# first instruction; feed it "continue".
echo c > "$WORK/cont.rc"
: > "$WORK/serial.log"

T0=$(date +%s.%N)
bochs-bin -q -f "$WORK/bochsrc" -rc "$WORK/cont.rc" </dev/null >"$WORK/bochs.out" 2>&1 &
BOCHS_PID=$!

# Stream the serial console to our stdout while Bochs runs.
filter() {
    # drop boot-loader noise before the program starts and the kernel's
    # power-off messages (unless EMU_VERBOSE=1); pass everything else through
    # mawk reads its input in blocks unless -W interactive
    local awk=(awk)
    awk -W version 2>&1 | grep -q mawk && awk=(awk -W interactive)
    "${awk[@]}" -v verbose="$VERBOSE" '
        { sub(/\r$/, "") }
        /^EMULATED-START/ { started = 1 }
        verbose != 1 && !started && (/^$/ || /^ISOLINUX / || /^Loading \//) { next }
        verbose != 1 && /^\[ *[0-9]+\.[0-9]+\] (reboot: Power down|ACPI: PM: Preparing)/ { next }
        { print; fflush() }'
}
tail -n +1 -s 0.2 -f --pid="$BOCHS_PID" "$WORK/serial.log" | filter &
TAIL_PID=$!

timed_out=0
if [ "$TIMEOUT" != 0 ]; then
    ( exec >/dev/null 2>&1; sleep "$TIMEOUT" & echo $! > "$WORK/wd.pid"; wait $!; kill "$BOCHS_PID" ) &
    WD_PID=$!
fi
started_at=; exited_at=; n=0
while kill -0 "$BOCHS_PID" 2>/dev/null; do
    sleep 0.5
    if [ -z "$started_at" ] && grep -q '^EMULATED-START' "$WORK/serial.log"; then
        started_at=$(date +%s.%N)
    fi
    if [ -z "$exited_at" ] && grep -aq 'EMULATED-EXIT [0-9]' "$WORK/serial.log"; then
        exited_at=$(date +%s.%N)
    fi
    # Bochs normally quits on the guest's ACPI power-off; don't rely on it.
    if [ -n "$exited_at" ]; then
        n=$((n + 1)); [ $n -gt 30 ] && { kill "$BOCHS_PID" 2>/dev/null || true; }
    fi
done
wait "$BOCHS_PID" 2>/dev/null || true
BOCHS_PID=
if [ -n "${WD_PID:-}" ]; then
    if kill -0 "$WD_PID" 2>/dev/null; then
        kill "$WD_PID" 2>/dev/null || true
        [ -s "$WORK/wd.pid" ] && kill "$(cat "$WORK/wd.pid")" 2>/dev/null || true
    else
        timed_out=1
    fi
fi
wait "$TAIL_PID" 2>/dev/null || true
T1=$(date +%s.%N)

[ -z "$started_at" ] && grep -q '^EMULATED-START' "$WORK/serial.log" && started_at=$T1
[ -z "$exited_at" ] && exited_at=$T1
# (not anchored: the program's last line may lack a newline)
rc_line=$(grep -ao 'EMULATED-EXIT [0-9]\+' "$WORK/serial.log" | tail -n 1 || true)
if [ -n "$started_at" ]; then
    log "$(awk -v a="$T0" -v b="$started_at" -v c="$exited_at" -v d="$T1" 'BEGIN{printf "wall: boot %.1fs, program %.1fs, shutdown %.1fs", b-a, c-b, d-c}')"
fi
if [ -n "$rc_line" ]; then
    exit "${rc_line#EMULATED-EXIT }"
fi
if [ "$timed_out" = 1 ]; then log "timed out after ${TIMEOUT}s (EMU_TIMEOUT)"; exit 124; fi
log "guest did not report an exit status; last Bochs messages:"
grep -a -E '^[0-9]+[ep]\[' "$WORK/bochs.log" 2>/dev/null | grep -v 'MSR: Unknown register' | tail -5 >&2 || true
tail -3 "$WORK/bochs.out" >&2 || true
exit 125
