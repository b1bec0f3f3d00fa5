# CMake generated Testfile for 
# Source directory: /work/main/examples/decoder
# Build directory: /work/main/build-decoder/examples/decoder
# 
# This file includes the relevant testing commands required for 
# testing this directory and lists subdirectories to be tested as well.
