#!/bin/sh
# nvcontainer's tarball installer, for a distribution that takes neither the .deb nor the .rpm:
#   ./install.sh                 install (or upgrade) the files of files/ under /, as the .deb does
#   /usr/share/nvcontainer/install.sh --uninstall    take them away again, with what setup did
# The same maintainer scripts as the packages (preinst, postinst, prerm, postrm beside this file).
# /usr/lib/nvcontainer is copied beside and renamed into place, so a failed copy (a full disk)
# leaves the node as it was; the list of installed files is kept in
# /usr/share/nvcontainer/tarball-files.list (which also tells the .deb and .rpm that this install
# is there).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
share=/usr/share/nvcontainer
list=$share/tarball-files.list
say() { echo "nvcontainer: $*" >&2; }
if [ "$(id -u)" != 0 ]; then
    say "install.sh runs as root"
    exit 1
fi
case "${1:-}" in
--uninstall)
    [ -f "$list" ] || { say "not installed from the tarball (no $list)"; exit 1; }
    sh "$share/tarball-prerm" remove
    while read -r f; do rm -f "$f"; done < "$list"
    rm -rf /usr/lib/nvcontainer
    dirs=$(sort -r "$share/tarball-dirs.list" 2>/dev/null || true)
    rm -f "$list" "$share/install.sh" "$share/tarball-prerm" "$share/tarball-dirs.list"
    cp "$share/tarball-postrm" /tmp/nvcontainer-postrm.$$ && rm -f "$share/tarball-postrm"
    for d in $dirs "$share" /usr/share/doc/nvcontainer; do rmdir "$d" 2>/dev/null || true; done
    sh /tmp/nvcontainer-postrm.$$ remove && sh /tmp/nvcontainer-postrm.$$ purge
    rm -f /tmp/nvcontainer-postrm.$$
    say "uninstalled"
    exit 0 ;;
"") ;;
*) say "usage: install.sh [--uninstall]"; exit 2 ;;
esac
[ -d "$here/files/usr/lib/nvcontainer" ] || { say "no files/ beside install.sh: run it from the unpacked tarball"; exit 1; }
if [ -f "$list" ]; then action=upgrade; else action=install; fi
sh "$here/preinst" "$action"
new=/usr/lib/.nvcontainer-new.$$
old=/usr/lib/.nvcontainer-old.$$
trap 'rm -rf "$new"' EXIT
if ! cp -a "$here/files/usr/lib/nvcontainer" "$new"; then
    say "copying /usr/lib/nvcontainer failed: nothing installed"
    exit 1
fi
[ -e /usr/lib/nvcontainer ] && mv /usr/lib/nvcontainer "$old"
mv "$new" /usr/lib/nvcontainer
rm -rf "$old"
# the directories this install makes (--uninstall takes them away again, not one that was there)
created=$(mktemp)
trap 'rm -rf "$new" "$created"' EXIT
(cd "$here/files" && find . -type d ! -path './usr/lib/nvcontainer*' | sed 's|^\.||') | while read -r d; do
    if [ -n "$d" ] && [ ! -d "$d" ]; then echo "$d" >> "$created"; fi
done
(cd "$here/files" && find . ! -type d ! -path './usr/lib/nvcontainer/*' | sed 's|^\.||') | while read -r f; do
    mkdir -p "$(dirname "$f")"
    cp -a "$here/files$f" "$f.nvcontainer-new" && mv -f "$f.nvcontainer-new" "$f"
done
mkdir -p "$share"
cp "$here/prerm" "$share/tarball-prerm"
cp "$here/postrm" "$share/tarball-postrm"
cp "$here/install.sh" "$share/install.sh"
if [ -f "$share/tarball-dirs.list" ]; then cat "$share/tarball-dirs.list" >> "$created"; fi
sort -u "$created" > "$share/tarball-dirs.list" && rm -f "$created"
cp "$here/files.list" "$list.tmp" && mv "$list.tmp" "$list"
sh "$here/postinst" configure
say "installed in /usr/lib/nvcontainer (uninstall: $share/install.sh --uninstall)"
