// Resharding: a destination piece (box D, elements [b, e) of D) is filled
// from the saved pieces of its tensor.
//
// Saved pieces are grouped by box. For each saved box B that meets D:
//   I = D ∩ B (per-dim interval intersection); skipped when the flat span
//   of I in D misses [b, e).
//   A box saved whole is read and viewed in B's shape. A box saved as flat
//   ranges (ZeRO-style shards of a box) is assembled into a buffer shaped
//   like B from the ranges that reach I's flat span in B only.
//   The overlap is one strided copy, B-view of I -> D-view of I, and a mask
//   of D records what was filled.
// The result is D's buffer flattened and cut to [b, e); every element of
// that range must have been filled, else the checkpoint does not cover the
// destination (an error that names both).
//
// Cost: each saved piece read once per load (ShardReader caches), one copy
// per overlap, plus D-sized buffer and mask; a destination that is a flat
// range of a large box still allocates the whole box (simple, and the boxes
// are parameters, not buckets).

#include "detail/reshard.h"

#include "detail/files.h"

#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <filesystem>
#include <sstream>

namespace commgrad::checkpoint::detail {

namespace fs = std::filesystem;

namespace {

std::string hex(uint32_t v) {
  std::ostringstream out;
  out << "0x" << std::hex << v;
  return out.str();
}

}  // namespace

const SafetensorsHeader& ShardReader::header(const std::string& file) {
  auto it = headers_.find(file);
  if (it != headers_.end()) return it->second;
  const std::string path = (fs::path(directory_) / file).string();
  std::error_code ec;
  TORCH_CHECK(fs::exists(path, ec), "shard file ", path, " is missing (rank ", index_.files.at(file).rank,
              " of the save wrote it)");
  const int64_t expected = index_.files.at(file).bytes;
  const auto size = static_cast<int64_t>(fs::file_size(path, ec));
  TORCH_CHECK(size >= expected, "shard file ", path, " is truncated: ", size, " bytes, the index records ", expected);
  TORCH_CHECK(size == expected, "shard file ", path, " has ", size, " bytes, the index records ", expected,
              " (it is not the file this index was written with)");
  return headers_.emplace(file, read_safetensors_header(path)).first->second;
}

at::Tensor ShardReader::read(const std::string& name, const SavedTensor& tensor, const SavedPiece& piece) {
  const std::string cache_key = piece.file + "\n" + piece.key;
  auto cached = cache_.find(cache_key);
  if (cached != cache_.end()) return cached->second;
  const SafetensorsHeader& h = header(piece.file);
  auto entry = h.tensors.find(piece.key);
  TORCH_CHECK(entry != h.tensors.end(), "shard file ", h.path, " has no entry '", piece.key, "' (tensor '", name, "')");
  const SafetensorsInfo& info = entry->second;
  const at::ScalarType dtype = *dtype_from_safetensors(tensor.dtype);
  const int64_t count = piece.flat_end - piece.flat_begin;
  TORCH_CHECK(info.dtype == tensor.dtype && volume(info.shape) == count &&
                  info.end - info.begin == count * static_cast<int64_t>(c10::elementSize(dtype)),
              "shard file ", h.path, ": entry '", piece.key, "' is ", info.dtype, " ", shape_name(info.shape),
              ", the index records ", tensor.dtype, " with ", count, " elements");
  uint32_t crc = 0;
  at::Tensor data = read_safetensors_tensor(h, info, dtype, &crc);
  TORCH_CHECK(crc == piece.crc32, "checksum mismatch in shard file ", h.path, ", entry '", piece.key, "' (tensor '",
              name, "' box ", box_name(piece.box), "): crc32 ", hex(crc), ", the index records ", hex(piece.crc32));
  cache_.emplace(cache_key, data);
  return data;
}

at::Tensor assemble(const PieceInfo& dest, const SavedTensor& tensor, ShardReader& reader) {
  const at::ScalarType dtype = *dtype_from_safetensors(tensor.dtype);
  const int64_t n = volume(dest.box.shape);
  at::Tensor staged = at::empty({n}, at::TensorOptions().dtype(dtype));
  at::Tensor filled = at::zeros({n}, at::kBool);
  const at::Tensor staged_box = staged.view(dest.box.shape);
  const at::Tensor filled_box = filled.view(dest.box.shape);

  std::vector<std::pair<Box, std::vector<const SavedPiece*>>> boxes;
  for (const SavedPiece& p : tensor.pieces) {
    auto it = std::find_if(boxes.begin(), boxes.end(), [&](const auto& b) { return b.first == p.box; });
    if (it == boxes.end()) {
      boxes.push_back({p.box, {}});
      it = std::prev(boxes.end());
    }
    it->second.push_back(&p);
  }
  for (const auto& [box, saved] : boxes) {
    const auto overlap = intersect(dest.box, box);
    if (!overlap) continue;
    const auto in_dest = flat_span(dest.box, *overlap);
    if (in_dest.second <= dest.flat_begin || in_dest.first >= dest.flat_end) continue;
    at::Tensor source;
    at::Tensor source_filled;  // undefined: all of it
    if (saved.size() == 1 && saved[0]->whole_box()) {
      source = reader.read(dest.name, tensor, *saved[0]).view(box.shape);
    } else {
      const int64_t m = volume(box.shape);
      const auto need = flat_span(box, *overlap);
      at::Tensor flat = at::empty({m}, at::TensorOptions().dtype(dtype));
      at::Tensor flat_filled = at::zeros({m}, at::kBool);
      for (const SavedPiece* p : saved) {
        if (p->flat_end <= need.first || p->flat_begin >= need.second || p->flat_end == p->flat_begin) continue;
        const int64_t count = p->flat_end - p->flat_begin;
        flat.narrow(0, p->flat_begin, count).copy_(reader.read(dest.name, tensor, *p));
        flat_filled.narrow(0, p->flat_begin, count).fill_(true);
      }
      source = flat.view(box.shape);
      source_filled = flat_filled.view(box.shape);
    }
    box_view(staged_box, dest.box, *overlap).copy_(box_view(source, box, *overlap));
    at::Tensor mask = box_view(filled_box, dest.box, *overlap);
    if (source_filled.defined()) {
      mask.logical_or_(box_view(source_filled, box, *overlap));
    } else {
      mask.fill_(true);
    }
  }
  const int64_t count = dest.count();
  const int64_t covered = filled.narrow(0, dest.flat_begin, count).sum().item<int64_t>();
  if (covered != count) {
    std::string saved_boxes;
    for (size_t i = 0; i < boxes.size() && i < 8; ++i) saved_boxes += (i ? ", " : "") + box_name(boxes[i].first);
    if (boxes.size() > 8) saved_boxes += ", ...";
    TORCH_CHECK(false, "tensor '", dest.name, "' ", shape_name(tensor.global_shape), ": the saved pieces (boxes ",
                saved_boxes.empty() ? std::string("none") : saved_boxes, ") cover ", covered, " of the ", count,
                " elements of the destination box ", box_name(dest.box), " elements [", dest.flat_begin, ", ",
                dest.flat_end, ")");
  }
  return staged.narrow(0, dest.flat_begin, count);
}

}  // namespace commgrad::checkpoint::detail
