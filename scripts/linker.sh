#!/bin/sh
# The linker cargo calls (.cargo/config.toml): the C compiler driver, with mold where mold is
# installed (several times faster on the workspace's large debug binaries), else as it is.
if command -v mold >/dev/null 2>&1; then
  exec cc -fuse-ld=mold "$@"
fi
exec cc "$@"
