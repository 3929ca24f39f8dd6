// pw::set_pool, the Python side of pool.h: only the translation unit that defines an
// extension's module includes this (it needs pybind11, through torch/extension.h).

#pragma once

#include <torch/extension.h>

#include "pool.h"

namespace pw {

// Binds this extension to the pool behind `capsule` (cpu_pool's api()); None unbinds.
inline void set_pool(const pybind11::object& capsule) {
  if (capsule.is_none()) {
    pool_api() = nullptr;
    return;
  }
  auto* api = static_cast<const PwPoolApi*>(PyCapsule_GetPointer(capsule.ptr(), kPwPoolCapsuleName));
  if (api == nullptr) throw pybind11::error_already_set();
  TORCH_CHECK(api->version == kPwPoolApiVersion, "cpu_pool: api version ", api->version, ", want ",
              kPwPoolApiVersion);
  pool_api() = api;
}

}  // namespace pw
