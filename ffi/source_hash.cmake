# Writes OUT, a header defining JAX_EP_SOURCE_HASH: the SHA-256 of one line "path:sha256" per
# file the extension is built from (CMakeLists.txt and ffi/'s sources; paths relative to ROOT,
# sorted), so that a loaded extension tells which sources it came from. jax_ep/_native.py
# hashes a checkout the same way (source_hash_of_checkout) and warns on a stale build.
#   cmake -DROOT=<checkout> -DOUT=<header> -P ffi/source_hash.cmake
file(GLOB_RECURSE files RELATIVE "${ROOT}"
     "${ROOT}/ffi/*.cu" "${ROOT}/ffi/*.cuh" "${ROOT}/ffi/*.h" "${ROOT}/ffi/*.cc"
     "${ROOT}/ffi/*.map" "${ROOT}/ffi/*.cmake")
list(APPEND files "CMakeLists.txt")
list(SORT files)
set(lines "")
foreach(f IN LISTS files)
  file(SHA256 "${ROOT}/${f}" digest)
  string(APPEND lines "${f}:${digest}\n")
endforeach()
string(SHA256 hash "${lines}")
file(WRITE "${OUT}.new" "#pragma once\n#define JAX_EP_SOURCE_HASH \"${hash}\"\n")
file(COPY_FILE "${OUT}.new" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.new")
