// Every typed-FFI handler the module exports (defined with XLA_FFI_DEFINE_HANDLER_SYMBOL).
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxEpLayout(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpDispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCachedDispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombine(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLDispatchSend(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLDispatchReceive(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLCombineSend(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLCombineReceive(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLDispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpLLCombine(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpNodeSend(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpNodeReturn(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpQuantizeFp8(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpBatchedMatmul(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpGroupedMatmul(XLA_FFI_CallFrame* call_frame);
}
