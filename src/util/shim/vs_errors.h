// Errors across the C boundary of vrtspike's C++ shims (src/ddp/shim/,
// src/model/shim/): no C++ exception may reach Rust, so an entry point returns
// an owned, malloc'd error string (NULL on success) that the Rust side frees.
// Header-only; the build scripts put this folder on the include path and in the
// shims' compile-cache key (build/shim.rs).

#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace vs_shim {

// A malloc'd copy of `text` (NULL if malloc fails).
inline char* owned_copy(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, text.c_str(), text.size() + 1);
  }
  return out;
}

// Runs `body`; NULL on success, else the exception's message as an owned string.
template <typename F>
char* guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    return owned_copy(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return owned_copy(e.what());
  } catch (...) {
    return owned_copy("unknown C++ exception");
  }
}

}  // namespace vs_shim
