#pragma once
/// \file thinkv.hpp
/// Umbrella header of the CUDA-free core.

#include "thinkv/backend/cpu_backend.hpp"
#include "thinkv/backend/kv_backend.hpp"
#include "thinkv/config.hpp"
#include "thinkv/formats.hpp"
#include "thinkv/paged/block_table.hpp"
#include "thinkv/paged/layout.hpp"
#include "thinkv/paged/paged_kv_cache.hpp"
#include "thinkv/policy/precision_map.hpp"
#include "thinkv/policy/retention_schedule.hpp"
#include "thinkv/reference/attention.hpp"
#include "thinkv/status.hpp"
#include "thinkv/tbe/eviction_plan.hpp"
#include "thinkv/tbe/kmeans.hpp"
#include "thinkv/thinkv_cache.hpp"
#include "thinkv/thought/calibration.hpp"
#include "thinkv/thought/calibration_file.hpp"
#include "thinkv/thought/classifier.hpp"
#include "thinkv/thought/trace.hpp"
#include "thinkv/types.hpp"
