"""HTTP server: SGLang-native and OpenAI-compatible APIs over the Engine."""
