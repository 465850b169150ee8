#pragma once
// commgrad's own transports: the intra-node shared-memory process group.

#include "commgrad/backend/shm_process_group.h"
