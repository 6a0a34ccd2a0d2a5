// The YaRN RoPE table at the real model's settings that the kernel tests share: 64 rotary dims,
// base 160000, original context 65536, factor 16, beta_fast 32, beta_slow 1.
#pragma once

#include "ops/cpu/rope.h"

namespace dsv4::test {

inline cpu::RopeTable v4_yarn_table() {
  return cpu::RopeTable::make(64, 160000, 65536, 16, 32, 1);
}

}  // namespace dsv4::test
