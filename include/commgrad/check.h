#pragma once
// commgrad::check: the distributed gradient checker (a parallel module on N
// ranks against its unsplit reference, every output and gradient compared).

#include "commgrad/check/gradient_check.h"
