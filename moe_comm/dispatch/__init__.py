"""Dispatch and combine: plan (counts exchange), transport, pipeline, num_chunks="auto", the Dispatcher."""
from moe_comm.dispatch.dispatcher import DispatchHandle, Dispatcher, DispatchOutput

__all__ = ["Dispatcher", "DispatchHandle", "DispatchOutput"]
