// The debug-mode cross-rank checks.
//
// Fingerprint. Each rank encodes its call as a fixed-size int64 record
// (sequence number, a text signature such as "all_reduce(float32[4, 3],
// op=sum)", and up to two per-rank lists such as all_to_all's splits); the
// group all-gathers the records with one small transport all_gather and
// every rank compares all of them. Because every rank sees every record,
// every rank raises the same mismatch, naming itself and the first rank that
// disagrees, before any mismatched collective reaches the transport (where
// Gloo would fail with "Connection closed by peer" or a timeout and leave the
// group unusable). The record size depends only on the group size, so the
// exchange itself can never mismatch. Point-to-point calls cannot use a
// collective; their two sides swap a small header instead.

#include "detail/fingerprint.h"

#include "detail/pending.h"
#include "detail/tags.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/debug.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstring>

namespace commgrad::ops::detail {
namespace {

constexpr int64_t kTextWords = 64;  // 512 bytes of signature

struct Record {
  int64_t sequence = 0;
  std::string text;
  std::vector<int64_t> a, b;
};

// The exchange is not the collective itself: its failure says so.
void wait_or_throw(const Call& call, const commgrad::detail::WorkPtr& work, const char* what) {
  try {
    commgrad::detail::wait_work(work);
  } catch (const std::exception& e) {
    COMMGRAD_THROW(ErrorKind::kPeerFailed, error_site(call.op, call.group, static_cast<int64_t>(call.sequence)), what,
                   " for collective #", call.sequence, " failed: ", message_of(e));
  }
}

std::string show(const Record& r) {
  std::string s = c10::str("#", r.sequence, " ", r.text);
  if (!r.a.empty()) s += c10::str(" ", at::IntArrayRef(r.a));
  if (!r.b.empty()) s += c10::str(" -> ", at::IntArrayRef(r.b));
  return s;
}

}  // namespace

void check_fingerprint(const Call& call, const std::string& signature, const std::vector<int64_t>& a,
                       const std::vector<int64_t>& b, CrossCheck cross) {
  if (!debug_checks() || call.size == 1) return;
  const int n = call.size;
  const int64_t words = 3 + kTextWords + 2 * n;
  auto mine = at::zeros({words}, at::kLong);
  int64_t* p = mine.data_ptr<int64_t>();
  const std::string text = signature.substr(0, kTextWords * 8 - 1);
  p[0] = static_cast<int64_t>(call.sequence);
  p[1] = static_cast<int64_t>(a.size());
  p[2] = static_cast<int64_t>(b.size());
  std::memcpy(p + 3, text.data(), text.size());
  std::copy(a.begin(), a.end(), p + 3 + kTextWords);
  std::copy(b.begin(), b.end(), p + 3 + kTextWords + n);

  auto all = at::empty({n, words}, at::kLong);
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < n; ++r) outputs[0].push_back(all[r]);
  std::vector<at::Tensor> inputs{mine};
  wait_or_throw(call, call.group.transport().allgather(outputs, inputs), "the debug fingerprint exchange");

  std::vector<Record> records(n);
  for (int r = 0; r < n; ++r) {
    const int64_t* q = all[r].data_ptr<int64_t>();
    records[r].sequence = q[0];
    const char* chars = reinterpret_cast<const char*>(q + 3);
    records[r].text.assign(chars, strnlen(chars, kTextWords * 8));
    records[r].a.assign(q + 3 + kTextWords, q + 3 + kTextWords + std::min<int64_t>(q[1], n));
    records[r].b.assign(q + 3 + kTextWords + n, q + 3 + kTextWords + n + std::min<int64_t>(q[2], n));
  }
  const Record& me = records[call.rank];
  const char* kHint = " (COMMGRAD_DEBUG check; nothing was sent, the group is still usable)";
  for (int r = 0; r < n; ++r) {
    const Record& other = records[r];
    const bool same = other.sequence == me.sequence && other.text == me.text &&
                      (cross != CrossCheck::kEqualLists || (other.a == me.a && other.b == me.b));
    COMMGRAD_CHECK_AS(ErrorKind::kMismatch, same, call.op, call.group, "ranks disagree on collective #", me.sequence,
                      kHint, ": this rank (", call.rank, ") calls ", show(me), "; rank ", r, " calls ", show(other));
  }
  if (cross == CrossCheck::kTransposed) {
    for (int r = 0; r < n; ++r) {
      for (int s = 0; s < n; ++s) {
        const int64_t sent = records[r].a.size() == static_cast<size_t>(n) ? records[r].a[s] : -1;
        const int64_t expected = records[s].b.size() == static_cast<size_t>(n) ? records[s].b[r] : -1;
        COMMGRAD_CHECK_AS(ErrorKind::kMismatch, sent == expected, call.op, call.group, "ranks disagree on collective #",
                          me.sequence, kHint, ": rank ", r, " sends ", sent, " to rank ", s, " (input_splits ",
                          at::IntArrayRef(records[r].a), "), but rank ", s, " expects ", expected, " from rank ", r,
                          " (output_splits ", at::IntArrayRef(records[s].b), "); this rank (", call.rank, ") calls ",
                          show(me));
      }
    }
  }
}

void check_p2p_header(const Call& call, int peer, int tag, bool sending, at::IntArrayRef sizes, at::ScalarType dtype,
                      bool requires_grad) {
  if (!debug_checks()) return;
  static constexpr int64_t kMaxDims = 10;
  constexpr int64_t kWords = 6 + kMaxDims;
  auto encode = [&](at::Tensor t) {
    int64_t* p = t.data_ptr<int64_t>();
    p[0] = 0x636f6d6d67726164;  // "commgrad"
    p[1] = sending ? 1 : 0;
    p[2] = tag;
    p[3] = static_cast<int64_t>(dtype);
    p[4] = requires_grad ? 1 : 0;
    p[5] = static_cast<int64_t>(sizes.size());
    for (int64_t i = 0; i < std::min<int64_t>(kMaxDims, sizes.size()); ++i) p[6 + i] = sizes[i];
  };
  auto describe = [&](const int64_t* p) {
    std::vector<int64_t> dims(p + 6, p + 6 + std::min<int64_t>(kMaxDims, std::max<int64_t>(0, p[5])));
    return c10::str(p[1] ? "sends " : "receives ", dtype_name(static_cast<at::ScalarType>(p[3])), shape_name(dims),
                    " (tag ", p[2], ", requires_grad=", p[4] ? "true" : "false", ")");
  };
  auto mine = at::zeros({kWords}, at::kLong);
  encode(mine);
  auto theirs = at::zeros({kWords}, at::kLong);
  std::vector<at::Tensor> out{mine}, in{theirs};
  auto& transport = call.group.transport();
  auto sent = transport.send(out, peer, kHeaderTagBase);
  wait_or_throw(call, transport.recv(in, peer, kHeaderTagBase), "the debug header exchange");
  wait_or_throw(call, sent, "the debug header exchange");
  const int64_t* m = mine.data_ptr<int64_t>();
  const int64_t* t = theirs.data_ptr<int64_t>();
  const bool ok = t[0] == m[0] && t[1] != m[1] && std::equal(m + 2, m + kWords, t + 2);
  COMMGRAD_CHECK_AS(ErrorKind::kMismatch, ok, call.op, call.group, "send/recv mismatch with rank ", peer,
                    " (COMMGRAD_DEBUG check; nothing was sent): this rank (", call.rank, ") ", describe(m), "; rank ",
                    peer, " ", describe(t));
}

}  // namespace commgrad::ops::detail
