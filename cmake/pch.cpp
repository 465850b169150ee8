// Compiled only to build the shared precompiled header (see cmake/CommgradTargets.cmake).
