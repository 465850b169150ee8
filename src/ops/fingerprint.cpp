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
// collective: a send sends a small header (sizes, dtype, tag) just before its
// message, and the receiver checks it when its recv is waited, before it
// uses the message. Only the receiver can check: an answer would have to
// travel back among the receiver's own messages to the sender, whose
// order (shm delivers a pair's messages in the order they were sent)
// nothing ties to the sender's receives, and a send that waited for one
// would stall a ring of sends (ring attention, 1F1B) for good.

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

namespace {

constexpr int64_t kMaxDims = 10;
constexpr int64_t kHeaderWords = 6 + kMaxDims;

at::Tensor encode_header(bool sending, int tag, at::IntArrayRef sizes, at::ScalarType dtype, bool requires_grad) {
  auto t = at::zeros({kHeaderWords}, at::kLong);
  int64_t* p = t.data_ptr<int64_t>();
  p[0] = 0x636f6d6d67726164;  // "commgrad"
  p[1] = sending ? 1 : 0;
  p[2] = tag;
  p[3] = static_cast<int64_t>(dtype);
  p[4] = requires_grad ? 1 : 0;
  p[5] = static_cast<int64_t>(sizes.size());
  for (int64_t i = 0; i < std::min<int64_t>(kMaxDims, sizes.size()); ++i) p[6 + i] = sizes[i];
  return t;
}

std::string describe_header(const int64_t* p) {
  std::vector<int64_t> dims(p + 6, p + 6 + std::min<int64_t>(kMaxDims, std::max<int64_t>(0, p[5])));
  return c10::str(p[1] ? "sends " : "receives ", dtype_name(static_cast<at::ScalarType>(p[3])), shape_name(dims),
                  " (tag ", p[2], ", requires_grad=", p[4] ? "true" : "false", ")");
}

}  // namespace

std::shared_ptr<P2pHeader> post_p2p_header(const Call& call, int peer, int tag, bool sending, at::IntArrayRef sizes,
                                           at::ScalarType dtype, bool requires_grad) {
  if (!debug_checks()) return nullptr;
  const at::Tensor mine = encode_header(sending, tag, sizes, dtype, requires_grad);
  auto& transport = call.group.transport();
  auto header = std::make_shared<P2pHeader>();
  if (sending) {
    std::vector<at::Tensor> out{mine};
    header->works.push_back(transport.send(out, peer, tag));
    header->verify = [mine] {};  // keeps the header alive until the call is waited
    return header;
  }
  const at::Tensor theirs = at::zeros({kHeaderWords}, at::kLong);
  std::vector<at::Tensor> in{theirs};
  header->works.push_back(transport.recv(in, peer, tag));
  header->verify = [call, peer, mine, theirs] {
    const int64_t* m = mine.data_ptr<int64_t>();
    const int64_t* t = theirs.data_ptr<int64_t>();
    const bool ok = t[0] == m[0] && t[1] == 1 && std::equal(m + 2, m + kHeaderWords, t + 2);
    COMMGRAD_CHECK_AS(ErrorKind::kMismatch, ok, call.op, call.group, "send/recv mismatch with rank ", peer,
                      " (COMMGRAD_DEBUG check, found by the receiver before it used the message; a mismatch of "
                      "sizes can leave point-to-point on this group unusable): this rank (",
                      call.rank, ") ", describe_header(m), "; rank ", peer, " ", describe_header(t));
  };
  return header;
}

}  // namespace commgrad::ops::detail
