"""What every stage uses and nothing above it: files written whole (io), numbers as people read them (formats),
logging (logs), progress lines (progress), where a result came from (provenance), and device discovery, GPU slots and
process setup (devices). Imports nothing else of the package."""
