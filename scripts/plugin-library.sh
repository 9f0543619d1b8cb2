# Sourced by setup.sh and install.sh: `plugin_library MANIFEST` prints the library file a
# plugin.toml names for this OS (a plain name, or a per-OS table), empty if it names none.
plugin_library() {
    python3 -c 'import sys, tomllib, platform
lib = tomllib.load(open(sys.argv[1], "rb"))["plugin"]["library"]
print(lib if isinstance(lib, str) else lib.get("macos" if platform.system() == "Darwin" else "linux", ""))' "$1"
}
