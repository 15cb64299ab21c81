"""The Open Inference Protocol: datatypes, tensor codecs, input checks, model metadata."""
