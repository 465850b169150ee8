#include "output.h"

#include "process.h"

namespace commgrad::run {
namespace {

// A "line" longer than this is written out in pieces: the launcher's memory
// stays bounded even when a rank prints megabytes without a newline.
constexpr std::size_t kMaxPendingLine = 1 << 20;

}  // namespace

void LineForwarder::feed(const char* data, std::size_t size) {
  pending_.append(data, size);
  const std::size_t last_newline = pending_.rfind('\n');
  if (last_newline == std::string::npos) {
    if (pending_.size() >= kMaxPendingLine) finish();
    return;
  }
  std::string text;
  if (prefix_.empty()) {
    text = pending_.substr(0, last_newline + 1);
  } else {
    std::size_t begin = 0;
    while (begin <= last_newline) {
      const std::size_t end = pending_.find('\n', begin);
      text += prefix_;
      text.append(pending_, begin, end - begin + 1);
      begin = end + 1;
    }
  }
  pending_.erase(0, last_newline + 1);
  emit(text);
}

void LineForwarder::finish() {
  if (pending_.empty()) return;
  std::string text;
  if (prefix_.empty()) {
    text.swap(pending_);
  } else {
    text = prefix_ + pending_ + "\n";
  }
  pending_.clear();
  emit(text);
}

void LineForwarder::emit(std::string& text) {
  // One write per batch of whole lines; a failed write (say, our reader went
  // away) is dropped so the ranks are still supervised to the end.
  write_all(out_fd_, text.data(), text.size());
}

}  // namespace commgrad::run
