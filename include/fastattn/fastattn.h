// fastattn: efficient transformer attention for LibTorch. One include for the
// whole public API of the core library (libfastattn). The experiments built on
// it (training, tasks, BERT, WordPiece, the MiniLM approximation) are a library
// of their own, libfastattn_experiments, with headers under
// fastattn/experiments/.
#pragma once

#include "fastattn/aft.h"
#include "fastattn/attention.h"
#include "fastattn/clustered.h"
#include "fastattn/clusterformer.h"
#include "fastattn/feature_maps.h"
#include "fastattn/generation.h"
#include "fastattn/hard_retrieval.h"
#include "fastattn/mask.h"
#include "fastattn/ops.h"
#include "fastattn/recurrent.h"
#include "fastattn/reformer.h"
#include "fastattn/recurrent_transformer.h"
#include "fastattn/registry.h"
#include "fastattn/sparse.h"
#include "fastattn/transformer.h"
#include "fastattn/safetensors.h"
