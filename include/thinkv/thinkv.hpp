#pragma once
/// \file thinkv.hpp
/// Umbrella header of the runtime: the CUDA-free core a decoder needs (`thinkv::core`). The
/// offline tooling (sparsity traces, KDE calibration, the calibration file, plots) is the
/// calibration component: `<thinkv/calibration.hpp>`, `thinkv::calibration`.

#include "thinkv/backend/cpu_backend.hpp"
#include "thinkv/backend/kv_backend.hpp"
#include "thinkv/config.hpp"
#include "thinkv/formats.hpp"
#include "thinkv/paged/block_table.hpp"
#include "thinkv/paged/layout.hpp"
#include "thinkv/paged_kv_cache.hpp"
#include "thinkv/policy/cache_policy.hpp"
#include "thinkv/policy/precision_map.hpp"
#include "thinkv/policy/retention_schedule.hpp"
#include "thinkv/reference/attention.hpp"
#include "thinkv/status.hpp"
#include "thinkv/tbe/eviction_plan.hpp"
#include "thinkv/tbe/kmeans.hpp"
#include "thinkv/tbe/token_selector.hpp"
#include "thinkv/thinkv_cache.hpp"
#include "thinkv/thought/classifier.hpp"
#include "thinkv/types.hpp"
