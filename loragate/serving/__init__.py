"""The serving core: decisions about which models run, below the HTTP layer (nothing here
imports the gateway, Starlette or FastAPI), each a plain function its caller applies."""
