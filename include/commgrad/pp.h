#pragma once
// commgrad pipeline parallelism: schedules as data with their simulator, and
// the runtime that executes them over a pipeline-parallel group.

#include "commgrad/pp/pipeline.h"
#include "commgrad/pp/schedule.h"
#include "commgrad/pp/simulator.h"
