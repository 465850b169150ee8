#pragma once
// The tensor-parallel side of the parallel layout. The layout itself
// (ParallelState, its groups and rank order) lives in dist/ since every
// dimension asks it for its groups; the names it had here are kept as
// aliases for one release.

#include "commgrad/dist/parallel_state.h"

namespace commgrad::tp {

/// `group` when defined, else the current state's tensor-parallel group;
/// errors, naming `op`, when neither exists. Layers and mappings resolve
/// their group argument with it.
Group resolve_tp_group(const Group& group, const char* op);

// Aliases of the layout's names before it moved to dist/ (one release).
using commgrad::data_parallel_group;
using commgrad::data_parallel_rank;
using commgrad::data_parallel_size;
using commgrad::destroy_model_parallel;
using commgrad::initialize_model_parallel;
using commgrad::make_model_parallel;
using commgrad::model_parallel_is_initialized;
using commgrad::parallel_state;
using commgrad::ParallelState;
using commgrad::pipeline_parallel_group;
using commgrad::ScopedParallelState;
using commgrad::tensor_parallel_group;
using commgrad::tensor_parallel_rank;
using commgrad::tensor_parallel_size;
/// commgrad::self_group() under its former name.
inline Group single_rank_group() { return self_group(); }

}  // namespace commgrad::tp
