#!/usr/bin/env bash
# Install the Debian packages named as arguments that are not installed yet (root only).
# A package that cannot be installed is reported and skipped: what needs it then skips with the reason,
# instead of one unavailable package stopping the whole set-up.
set -uo pipefail
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
	echo "not root or no apt-get: skipping system packages ($*); what needs them will skip or report why"
	exit 0
fi
missing=()
for p in "$@"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
export DEBIAN_FRONTEND=noninteractive
echo "apt-get install ${missing[*]}"
if apt-get install -y -q "${missing[@]}" >/tmp/cri-resmgr-apt.log 2>&1; then exit 0; fi
apt-get update -q >>/tmp/cri-resmgr-apt.log 2>&1
if apt-get install -y -q "${missing[@]}" >>/tmp/cri-resmgr-apt.log 2>&1; then exit 0; fi
failed=()
for p in "${missing[@]}"; do
	apt-get install -y -q "$p" >>/tmp/cri-resmgr-apt.log 2>&1 || failed+=("$p")
done
if [ ${#failed[@]} -gt 0 ]; then
	echo "WARNING: could not install: ${failed[*]} (see /tmp/cri-resmgr-apt.log); tests that need them will skip"
fi
exit 0
