"""NRI and ttrpc messages: our own ``.proto`` files (public field numbers) and the modules protoc made of them."""
