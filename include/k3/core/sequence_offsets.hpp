// k3/core/sequence_offsets.hpp — packed variable-length sequences, one type for every
// capability: N+1 offsets into T, int32 or int64, on the host.
#pragma once
#include <cstdint>
#include <vector>

#include "k3/core/error.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3 {

// Packed variable-length sequences: N+1 offsets into T, int32 or int64. Empty = not packed.
class cu_seqlens_view {
 public:
  cu_seqlens_view() = default;
  cu_seqlens_view(tensor_view<std::int32_t const, 1> v) : p32_(v.data_handle()), n_(v.extent(0)), s_(v.stride(0)), on_(true) {}
  cu_seqlens_view(tensor_view<std::int32_t, 1> v) : cu_seqlens_view(tensor_view<std::int32_t const, 1>(v)) {}
  cu_seqlens_view(tensor_view<std::int64_t const, 1> v) : p64_(v.data_handle()), n_(v.extent(0)), s_(v.stride(0)), on_(true) {}
  cu_seqlens_view(tensor_view<std::int64_t, 1> v) : cu_seqlens_view(tensor_view<std::int64_t const, 1>(v)) {}
  cu_seqlens_view(std::vector<std::int64_t> const& v) : p64_(v.data()), n_(static_cast<index_t>(v.size())), s_(1), on_(true) {}
  cu_seqlens_view(std::vector<std::int32_t> const& v) : p32_(v.data()), n_(static_cast<index_t>(v.size())), s_(1), on_(true) {}
  // A view: offsets in a temporary vector would dangle once the statement ends, so that does
  // not compile (name the vector).
  cu_seqlens_view(std::vector<std::int64_t>&&) = delete;
  cu_seqlens_view(std::vector<std::int32_t>&&) = delete;

  // Any explicitly given offsets (even an empty list, which is then rejected) mean packed.
  bool present() const noexcept { return on_; }
  bool is_int32() const noexcept { return p32_ != nullptr; }
  index_t size() const noexcept { return n_; }
  index_t operator[](index_t i) const noexcept { return p32_ ? index_t(p32_[i * s_]) : index_t(p64_[i * s_]); }
  void const* data() const noexcept { return p32_ ? static_cast<void const*>(p32_) : static_cast<void const*>(p64_); }

 private:
  std::int32_t const* p32_ = nullptr;
  std::int64_t const* p64_ = nullptr;
  index_t n_ = 0, s_ = 1;
  bool on_ = false;
};

// Optional views and offsets are asked the same question.
inline bool present(cu_seqlens_view const& c) noexcept { return c.present(); }

}  // namespace k3
