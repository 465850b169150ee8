#pragma once
// commgrad::check: the distributed gradient checker (a parallel module on N
// ranks against its unsplit reference, every output and gradient compared)
// and the trajectory checker (a training loop against one rank, step by step).

#include "commgrad/check/gradient_check.h"
#include "commgrad/check/trajectory.h"
