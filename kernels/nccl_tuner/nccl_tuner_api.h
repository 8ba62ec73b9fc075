/* The part of NCCL's tuner-plugin interface this plugin implements, declared here from
 * NCCL's published ext-tuner header (NCCL 2.28: src/include/plugin/nccl_tuner.h and
 * tuner/tuner_v3.h .. tuner_v5.h). Only the layouts NCCL relies on are declared; the
 * names follow NCCL's so that the correspondence is easy to check.
 *
 * NCCL 2.28 looks up ncclTunerPlugin_v5, then _v4, _v3, _v2, in the library named by
 * NCCL_TUNER_PLUGIN, and uses the first it finds. */
#ifndef COMMTUNE_NCCL_TUNER_API_H
#define COMMTUNE_NCCL_TUNER_API_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6
} ncclResult_t;

typedef enum {
  NCCL_LOG_NONE = 0, NCCL_LOG_VERSION = 1, NCCL_LOG_WARN = 2, NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4, NCCL_LOG_TRACE = 5
} ncclDebugLogLevel;

/* subsystem flags used by this plugin */
#define NCCL_INIT 0x1
#define NCCL_TUNING 0x40

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char *file,
                                  int line, const char *fmt, ...);

/* NCCL's collective functions (the first five are the collectives a tuner is asked about) */
typedef enum {
  ncclFuncBroadcast = 0,
  ncclFuncReduce = 1,
  ncclFuncAllGather = 2,
  ncclFuncReduceScatter = 3,
  ncclFuncAllReduce = 4
} ncclFunc_t;

/* the cost table's indices: collCostTable[algorithm][protocol], contiguous floats, numProto per row */
#define NCCL_ALGO_TREE 0
#define NCCL_ALGO_RING 1
#define NCCL_ALGO_COLLNET_DIRECT 2
#define NCCL_ALGO_COLLNET_CHAIN 3
#define NCCL_ALGO_NVLS 4
#define NCCL_ALGO_NVLS_TREE 5
#define NCCL_ALGO_PAT 6
#define NCCL_PROTO_LL 0
#define NCCL_PROTO_LL128 1
#define NCCL_PROTO_SIMPLE 2
/* an entry NCCL has ruled out (algorithm or protocol unavailable for this call) */
#define NCCL_ALGO_PROTO_IGNORE -1.0f

/* v5 (NCCL 2.27+) */
typedef struct {
  int nNvlDomains;
  int minRanksPerNvlDomain;
  int maxRanksPerNvlDomain;
} ncclNvlDomainInfo_v5_t;

/* v5's tuner constants: NCCL's latency and bandwidth model inputs, which a plugin may
 * rewrite at init. This plugin leaves them alone and never reads them, so the struct is
 * left opaque. */
typedef struct ncclTunerConstants_v5 ncclTunerConstants_v5_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **ctx, uint64_t commId, size_t nRanks, size_t nNodes,
                       ncclDebugLogger_t logFunction, ncclNvlDomainInfo_v5_t *nvlDomainInfo,
                       ncclTunerConstants_v5_t *constants);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int regBuff,
                              int *nChannels);
  ncclResult_t (*finalize)(void *context);
} ncclTuner_v5_t;

/* v4 (NCCL 2.23 .. 2.26): init without commId, NVL domains and constants; destroy */
typedef struct {
  const char *name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void **context);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int regBuff,
                              int *nChannels);
  ncclResult_t (*destroy)(void *context);
} ncclTuner_v4_t;

/* v3 (NCCL 2.22): as v4 without regBuff */
typedef struct {
  const char *name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void **context);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int *nChannels);
  ncclResult_t (*destroy)(void *context);
} ncclTuner_v3_t;

#endif
