"""Runs INSIDE an image (``python -c``), not under pytest: what imports, and what files are there.

argv[1]: a JSON list of module names to import. Prints one JSON object: per module "ok" or the error (for a
missing module, the name Python could not find), the site-packages directory and its files, every path
of the root filesystem (not /proc, /sys, /dev), the uid, and which paths can be written.
"""

import importlib
import json
import os
import sys
import sysconfig

WRITE_PROBES = ["/", "/etc", "/opt", "/usr", "/var/tmp", "/run", "/root", "/home", "/tmp"]


def main() -> None:
    imports = {}
    for name in json.loads(sys.argv[1]):
        try:
            importlib.import_module(name)
            imports[name] = "ok"
        except ModuleNotFoundError as exc:
            imports[name] = f"missing {exc.name}"
        except Exception as exc:
            imports[name] = f"{type(exc).__name__}: {exc}"
    site = sysconfig.get_paths()["purelib"]
    files = []
    for directory, dirs, names in os.walk(site):
        files += [os.path.relpath(os.path.join(directory, n), site) for n in names]
        files += [os.path.relpath(os.path.join(directory, n), site) + "/" for n in dirs]
    paths = []
    for directory, dirs, names in os.walk("/"):
        dirs[:] = [d for d in dirs if os.path.join(directory, d) not in ("/proc", "/sys", "/dev")]
        paths += [os.path.join(directory, n) for n in dirs + names]
    writable = []
    for directory in WRITE_PROBES:
        try:
            with open(os.path.join(directory, f".probe-{os.getpid()}"), "w") as sink:
                sink.write("x")
            os.unlink(sink.name)
            writable.append(directory)
        except OSError:
            pass
    print(
        json.dumps(
            {
                "imports": imports,
                "site": site,
                "files": files,
                "paths": paths,
                "uid": os.getuid(),
                "writable": writable,
                "python": sys.version.split()[0],
            }
        )
    )


main()
